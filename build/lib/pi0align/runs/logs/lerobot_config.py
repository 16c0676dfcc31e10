"""LeRobot's training config (`train_config.json` in its checkpoints, or the dict `lerobot-train`
prints first) as the manifest keys runs/envdiff.py's items read."""

from __future__ import annotations

import json
from typing import Any


def is_lerobot_config(value: Any) -> bool:
    """A LeRobot TrainPipelineConfig as `train_config.json` (or its printed dict) holds it."""
    return isinstance(value, dict) and isinstance(value.get("policy"), dict) and "dataset" in value \
        and "optimizer" in value


def lerobot_manifest(config: dict[str, Any]) -> dict[str, Any]:
    """LeRobot's training config as manifest keys (runs/envdiff.py's items): the seed, the loop's
    settings, the optimizer and scheduler that trained (LeRobot's resolved ones), the policy's own
    hyper-parameters by their PI0 names."""
    policy, optimizer = config.get("policy") or {}, config.get("optimizer") or {}
    scheduler, dataset = config.get("scheduler") or {}, config.get("dataset") or {}
    hyper = {f"optimizer_{name}": optimizer[key] for name, key in (
        ("lr", "lr"), ("betas", "betas"), ("eps", "eps"), ("weight_decay", "weight_decay"),
        ("grad_clip_norm", "grad_clip_norm")) if key in optimizer}
    hyper |= {f"scheduler_{name}": scheduler[key] for name, key in (
        ("warmup_steps", "num_warmup_steps"), ("decay_steps", "num_decay_steps"), ("decay_lr", "decay_lr"))
        if key in scheduler}
    hyper |= {key: policy[key] for key in ("chunk_size", "n_action_steps", "max_state_dim", "max_action_dim",
                                           "image_resolution", "tokenizer_max_length", "num_inference_steps",
                                           "paligemma_variant", "action_expert_variant", "dtype") if key in policy}
    manifest = {"seed": config.get("seed"), "policy_type": policy.get("type"), "hyperparameters": hyper,
            "config": {"device": policy.get("device"), "seed": config.get("seed"), "steps": config.get("steps"),
                       "batch_size": config.get("batch_size"), "num_workers": config.get("num_workers"),
                       "optimizer": optimizer.get("type"), "log_every": config.get("log_freq"),
                       "save_every": config.get("save_freq"), "out": config.get("output_dir"),
                       "dataset": dataset.get("root") or dataset.get("repo_id"),
                       "use_amp": policy.get("use_amp")}}
    return json.loads(json.dumps(manifest))  # tuples as lists, as a JSON manifest holds them
