"""Checkpoints: `<run>/checkpoints/<NNNNNN>/` after NNNNNN completed steps.

Each holds `pretrained_model/` (LeRobot's layout: config.json + model.safetensors, loadable with
`--pretrained`), `training_state.pt` (optimizer, scheduler, every rank's RNG states, step) and
`train_config.json`; under `--engine deepspeed` the optimizer's state is DeepSpeed's, in its own
files in `deepspeed/` (train/engines.py). Written to a temporary folder and renamed, so a checkpoint is whole or absent.
A checkpoint loads on any device: tensors are read to the CPU and moved where the run computes,
and the device's own generator is restored on the same kind of device only (PI0's noise is drawn
from the CPU generator, which is restored everywhere).
"""

from __future__ import annotations

import pickle
import random
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch

from pi0align.errors import UserError
from pi0align.pi0.policy import load_weights, save_weights
from pi0align.train.config import TrainConfig

TRAINING_STATE = "training_state.pt"
CONFIG_FILE = "train_config.json"


def checkpoint_dir(run_dir: Path, steps_done: int) -> Path:
    return run_dir / "checkpoints" / f"{steps_done:06d}"


def rng_state(device) -> dict:
    """Every generator of this process: python's, numpy's, torch's CPU one, the device's; in types
    torch.load reads with `weights_only` (a checkpoint runs no code when it is read)."""
    numpy_state = np.random.get_state(legacy=False)
    numpy_state["state"]["key"] = torch.from_numpy(numpy_state["state"]["key"].astype(np.int64))
    return {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state(),
            "device": device.rng_state(), "device_type": device.type}


def _set_rng_state(rng: dict, device) -> None:
    numpy_state = rng["numpy"]
    numpy_state["state"]["key"] = numpy_state["state"]["key"].numpy().astype(np.uint32)
    random.setstate(rng["python"])
    np.random.set_state(numpy_state)
    torch.set_rng_state(rng["torch"])
    if rng["device_type"] == device.type:  # another kind of device has another generator
        device.set_rng_state(rng["device"])


def staging_dir(run_dir: Path, steps_done: int) -> Path:
    """Where a checkpoint is written before it is renamed into place."""
    final = checkpoint_dir(run_dir, steps_done)
    return final.with_name(final.name + ".partial")


def save(run_dir: Path, steps_done: int, *, policy, optimizer: torch.optim.Optimizer, scheduler,
         config: TrainConfig, rng: list[dict], staged: bool = False) -> Path:
    """`optimizer`: its state_dict is saved, with its parameters' names in its order (what
    `ckpt-diff --optimizer` reads), unless `staged`: the engine has written the staging folder's
    optimizer state itself (DeepSpeed), and only the names are saved; `rng`: every rank's
    rng_state, in rank order."""
    final, staging = checkpoint_dir(run_dir, steps_done), staging_dir(run_dir, steps_done)
    if not staged:
        shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True, exist_ok=True)
    save_weights(policy, staging / "pretrained_model")
    torch.save(
        {
            "steps_done": steps_done,
            "optimizer": None if staged else optimizer.state_dict(),
            "optimizer_names": optimizer_names(policy, optimizer),
            "scheduler": scheduler.state_dict(),
            "rng": rng,
        },
        staging / TRAINING_STATE,
    )
    config.save(staging / CONFIG_FILE)
    shutil.rmtree(final, ignore_errors=True)
    staging.rename(final)
    return final


def optimizer_names(policy, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of each parameter the optimizer holds, in the order its state_dict numbers them."""
    names = {id(p): name for name, p in policy.named_parameters()}
    return [names.get(id(p), f"param_groups.{g}.{i}") for g, group in enumerate(optimizer.param_groups)
            for i, p in enumerate(group["params"])]


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


def restore(checkpoint: Path, *, policy, optimizer, scheduler, device, rank: int = 0) -> int:
    """Load weights, optimizer, scheduler (each where given: an engine may load them itself) and
    this rank's RNG states; returns the number of steps already done."""

    try:
        with warnings.catch_warnings():  # torch's on a pickle of an unexpected protocol: the error says it
            warnings.simplefilter("ignore")
            state = torch.load(checkpoint / TRAINING_STATE, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise UserError(f"cannot read {checkpoint / TRAINING_STATE}: it holds objects other than tensors and plain "
                        "data (not a checkpoint pi0align wrote; such objects are never unpickled)") from None
    except (OSError, RuntimeError, EOFError) as error:
        raise UserError(f"cannot read {checkpoint / TRAINING_STATE}: {str(error).splitlines()[0]}") from None
    if optimizer is not None and state["optimizer"] is None:
        raise UserError(f"{checkpoint} was written by --engine deepspeed: its optimizer state is DeepSpeed's "
                        "(resume it with --engine deepspeed)")
    if policy is not None:
        load_weights(policy, checkpoint / "pretrained_model")
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None:
        scheduler.load_state_dict(state["scheduler"])
    rng = state["rng"]  # one per rank
    if rank >= len(rng):
        raise UserError(f"{checkpoint} was saved by {len(rng)} process(es): it holds no rank {rank}")
    _set_rng_state(rng[rank], device)
    return int(state["steps_done"])
