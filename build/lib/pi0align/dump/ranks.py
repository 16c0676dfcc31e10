"""This process's rank and the world size: torch.distributed's once its group is made, else the
launcher's environment (RANK, WORLD_SIZE), else one process."""

from __future__ import annotations

import os

import torch


def rank_and_world_size() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
