"""LeRobot's own `lerobot-train`, unmodified, on the built-in synthetic dataset with a policy small
enough for a CPU: ACT with a one-layer transformer (11 M parameters, most its ResNet-18, without
pretrained weights: nothing to download). PI0 cannot train here under `lerobot-train`: its
processor fetches PaliGemma's tokenizer from the Hub, and its config admits the full Gemma sizes
only."""

from __future__ import annotations

import sys
from pathlib import Path

LEROBOT_TRAIN = str(Path(sys.executable).parent / "lerobot-train")
SMALL_ACT = ("--policy.type=act", "--policy.device=cpu", "--policy.push_to_hub=false",
             "--policy.pretrained_backbone_weights=null", "--policy.dim_model=64", "--policy.n_heads=2",
             "--policy.dim_feedforward=128", "--policy.n_encoder_layers=1", "--policy.n_decoder_layers=1",
             "--policy.chunk_size=10", "--policy.n_action_steps=10", "--policy.use_vae=false")


def lerobot_train(output_dir: Path, *, steps: int = 20, log_freq: int = 5, seed: int = 1234,
                  extra: tuple[str, ...] = ()) -> list[str]:
    """The command line of a small ACT training by `lerobot-train` (checkpoint at its last step)."""
    from pi0align.pi0.dataset import default_dataset

    return [LEROBOT_TRAIN, "--dataset.repo_id=local/synthetic_koch", f"--dataset.root={default_dataset()}",
            *SMALL_ACT, "--batch_size=4", f"--steps={steps}", f"--log_freq={log_freq}", f"--save_freq={steps}",
            "--num_workers=0", f"--seed={seed}", "--wandb.enable=false", f"--output_dir={output_dir}", *extra]
