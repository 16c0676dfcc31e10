"""The run manifest: what a second run must match to be comparable (coarse alignment)."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from pi0align.device import Device
from pi0align.pi0.policy import NOISE_DRAWS
from pi0align.provenance import environment, git_commit, weights_sha256


def build_manifest(*, config, device: Device, seed_impl: str, transformers_compat: str, policy, parameter_count: int,
                   dataset_root: Path, dataset_fingerprint: str, world_size: int = 1, rank: int = 0) -> dict:
    return {
        **environment(device, rank, world_size),
        "dtype": config.dtype,
        "seed": config.seed,
        "seed_impl": seed_impl,
        "transformers_compat": transformers_compat,
        "noise_draws": NOISE_DRAWS,
        "config": config.to_json(),
        "hyperparameters": _hyperparameters(policy.config),
        "parameter_count": parameter_count,
        "weights_sha256": weights_sha256(policy),
        "dataset": str(dataset_root),
        "dataset_fingerprint": dataset_fingerprint,
        "git_commit": git_commit(),
        "started": datetime.now().isoformat(timespec="seconds"),
    }


def _hyperparameters(policy_config) -> dict:
    """PI0's own training hyper-parameters as LeRobot resolves them."""
    names = ["optimizer_lr", "optimizer_betas", "optimizer_eps", "optimizer_weight_decay", "optimizer_grad_clip_norm",
             "scheduler_warmup_steps", "scheduler_decay_steps", "scheduler_decay_lr", "chunk_size", "n_action_steps",
             "max_state_dim", "max_action_dim", "image_resolution", "tokenizer_max_length", "dtype",
             "num_inference_steps", "paligemma_variant", "action_expert_variant"]
    values = {name: getattr(policy_config, name) for name in names}
    return {name: list(value) if isinstance(value, tuple) else value for name, value in values.items()}
