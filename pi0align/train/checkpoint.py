"""Checkpoints: `<run>/checkpoints/<NNNNNN>/` after NNNNNN completed steps.

Each holds `pretrained_model/` (LeRobot's layout: config.json + model.safetensors, loadable with
`--pretrained`), `training_state.pt` (optimizer, scheduler, every RNG state, step) and
`train_config.json`. Written to a temporary folder and renamed, so a checkpoint is whole or absent.
A checkpoint loads on any device: tensors are read to the CPU and moved where the run computes,
and the device's own generator is restored on the same kind of device only (PI0's noise is drawn
from the CPU generator, which is restored everywhere).
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import numpy as np
import torch

from pi0align.errors import UserError
from pi0align.train.config import TrainConfig

TRAINING_STATE = "training_state.pt"
CONFIG_FILE = "train_config.json"


def checkpoint_dir(run_dir: Path, steps_done: int) -> Path:
    return run_dir / "checkpoints" / f"{steps_done:06d}"


def save(run_dir: Path, steps_done: int, *, policy, optimizer, scheduler, config: TrainConfig, device) -> Path:
    final = checkpoint_dir(run_dir, steps_done)
    staging = final.with_name(final.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    policy.save_pretrained(staging / "pretrained_model")
    torch.save(
        {
            "steps_done": steps_done,
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "rng": {
                "python": random.getstate(),
                "numpy": np.random.get_state(),
                "torch": torch.get_rng_state(),
                "device": device.rng_state(),
                "device_type": device.type,
            },
        },
        staging / TRAINING_STATE,
    )
    config.save(staging / CONFIG_FILE)
    shutil.rmtree(final, ignore_errors=True)
    staging.rename(final)
    return final


def resolve(path: Path) -> Path:
    """A checkpoint folder, given it or its run folder (then the latest checkpoint)."""
    path = Path(path)
    if (path / TRAINING_STATE).is_file():
        return path
    candidates = sorted(p for p in (path / "checkpoints").glob("[0-9]" * 6) if (p / TRAINING_STATE).is_file())
    if not candidates:
        raise UserError(f"no checkpoint in {path} (--resume takes a run folder or one of its checkpoints/NNNNNN)")
    return candidates[-1]


def load_config(checkpoint: Path) -> TrainConfig:
    import json

    try:
        return TrainConfig.from_json(json.loads((checkpoint / CONFIG_FILE).read_text()))
    except (OSError, ValueError, TypeError) as error:
        raise UserError(f"cannot read {checkpoint / CONFIG_FILE}: {error}") from None


def restore(checkpoint: Path, *, policy, optimizer, scheduler, device) -> int:
    """Load weights, optimizer, scheduler and RNG states; returns the number of steps already done."""
    from pi0align.pi0.policy import load_weights

    load_weights(policy, checkpoint / "pretrained_model")
    try:
        state = torch.load(checkpoint / TRAINING_STATE, map_location="cpu", weights_only=False)
    except (OSError, RuntimeError, EOFError) as error:
        raise UserError(f"cannot read {checkpoint / TRAINING_STATE}: {error}") from None
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    rng = state["rng"]
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    if rng.get("device_type", device.type) == device.type:  # another kind of device has another generator
        device.set_rng_state(rng["device"])
    return int(state["steps_done"])
