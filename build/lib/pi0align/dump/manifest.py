"""The run manifest: what the dumper can tell about the environment and the model by itself,
completed by what the caller knows (seed, config, dataset) through `Dumper(manifest=...)`."""

from __future__ import annotations

import sys

import torch

from pi0align.device import Device
from pi0align.provenance import environment, weights_sha256

_KEYS = ("seed", "seed_impl", "config", "dataset_fingerprint", "git_commit")


def build_manifest(model: torch.nn.Module | None, rank: int, world_size: int, given: dict | None) -> dict:
    """Every key docs/dump-format.md promises; `given` values win over what is found here."""
    first = next(iter(model.parameters()), None) if model is not None else None
    device = Device(first.device.type, first.device.index) if first is not None else Device("cpu")
    manifest = {
        **environment(device, rank, world_size),
        "dtype": str(first.dtype).removeprefix("torch.") if first is not None else None,
        "weights_sha256": None,
        "argv": sys.argv,
        **{key: None for key in _KEYS},
    }
    given = dict(given or {})
    given_versions = given.pop("versions", None) or {}
    manifest.update(given)
    manifest["versions"].update(given_versions)
    if manifest["weights_sha256"] is None and model is not None:
        manifest["weights_sha256"] = weights_sha256(model)
    return manifest
