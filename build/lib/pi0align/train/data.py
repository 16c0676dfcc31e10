"""Batches in an order fixed by (seed, step): a run resumed at step k sees the batches it would have seen."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Sampler


class StepBatchSampler(Sampler[list[int]]):
    """Yields the index batches of steps `start_step`, `start_step + 1`, ... `steps - 1`: of each
    step's global batch (`batch_size` × `world_size` samples) the slice of `rank`.

    Each epoch is a permutation drawn from a generator seeded by (seed, epoch), dropping the last
    partial global batch as LeRobot's loader does; the training RNG is never touched.
    """

    def __init__(self, dataset_size: int, batch_size: int, seed: int, start_step: int, steps: int, rank: int = 0,
                 world_size: int = 1):
        if batch_size * world_size > dataset_size:
            raise ValueError(f"the global batch {batch_size * world_size} exceeds the dataset's {dataset_size} frames")
        self.dataset_size = dataset_size
        self.batch_size = batch_size
        self.seed = seed
        self.start_step = start_step
        self.steps = steps
        self.rank, self.world_size = rank, world_size
        self.batches_per_epoch = dataset_size // (batch_size * world_size)

    def __len__(self) -> int:
        return max(0, self.steps - self.start_step)

    def __iter__(self):
        epoch = None
        for step in range(self.start_step, self.steps):
            step_epoch, position = divmod(step, self.batches_per_epoch)
            if step_epoch != epoch:
                epoch = step_epoch
                generator = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
                permutation = torch.randperm(self.dataset_size, generator=generator).tolist()
            first = (position * self.world_size + self.rank) * self.batch_size
            yield permutation[first : first + self.batch_size]


def make_loader(dataset, *, batch_size: int, seed: int, start_step: int, steps: int, num_workers: int,
                pin_memory: bool, rank: int = 0, world_size: int = 1) -> DataLoader:
    sampler = StepBatchSampler(len(dataset), batch_size, seed, start_step, steps, rank, world_size)
    return DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        pin_memory=pin_memory,
        # Worker seeds come from this generator, not from the global RNG the model samples noise from.
        generator=torch.Generator().manual_seed(seed),
        persistent_workers=False,
        prefetch_factor=2 if num_workers > 0 else None,
    )
