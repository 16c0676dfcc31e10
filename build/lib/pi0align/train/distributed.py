"""Several processes, on one node or many, through torch.distributed's own launcher
(`torch.distributed.run`, what `torchrun` runs); `pi0align run` inside any launcher that sets
RANK, LOCAL_RANK, WORLD_SIZE and LOCAL_WORLD_SIZE (torchrun, DeepSpeed's, accelerate's) runs as
that rank. Never a launcher of our own.

Every rank seeds the same seed (msprobe's `seed_all` and accelerate's `set_seed` do the same): the
ranks start from the same weights, which DDP also broadcasts from rank 0; each rank trains on its
own slice of the step's global batch (data.StepBatchSampler).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pi0align.device import Device
from pi0align.errors import UserError
from pi0align.train.config import local_world_size


@dataclass(frozen=True)
class Ranks:
    """Where this process stands: its rank, its rank on its node, how many processes in all and on
    its node."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1

    @property
    def main(self) -> bool:
        """The rank that writes the run's log, summary, manifest and checkpoints."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def launched() -> Ranks:
    """The ranks a launcher gave this process through the environment (one process otherwise)."""
    try:
        values = [int(os.environ.get(name, default)) for name, default in (
            ("RANK", 0), ("LOCAL_RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_WORLD_SIZE", local_world_size()))]
    except ValueError as error:
        raise UserError(f"a launcher set RANK, LOCAL_RANK, WORLD_SIZE or LOCAL_WORLD_SIZE to a non-number: {error}") \
            from None
    return Ranks(*values)


def device_of_rank(spec: str, ranks: Ranks) -> str:
    """The device a rank computes on: `cuda` and `npu` take the rank's local index; the CPU is one."""
    if ranks.distributed and spec in ("cuda", "npu"):
        return f"{spec}:{ranks.local_rank}"
    return spec


def start(ranks: Ranks, device: Device) -> None:
    """Join the process group: gloo on the CPU, NCCL on CUDA, HCCL on the NPU."""
    if ranks.distributed and not dist.is_initialized():
        dist.init_process_group(backend=device.distributed_backend)


def start_alone(device: Device) -> None:
    """A process group of this process alone (an in-memory store, no port), for an engine that
    needs one in a single process (DeepSpeed's); nothing where a group is joined already."""
    if not dist.is_initialized():
        dist.init_process_group(backend=device.distributed_backend, store=dist.HashStore(), rank=0, world_size=1)


def stop(finished: bool) -> None:
    """Leave the process group; where this rank `finished` its work, only once every rank has (a
    barrier), so that no rank tears its connections down while another still uses them (PyTorch's
    own tests put a barrier before `destroy_process_group` for that; one CI run here saw rank 1 of
    two end with `terminate called without an active exception`, where is not known). A rank
    that failed leaves at once: the others may never reach a barrier."""
    if dist.is_initialized():
        if finished and dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()


def mean(value: float, ranks: Ranks) -> float:
    """The mean of a number over every rank (the loss of the global batch)."""
    if not ranks.distributed:
        return value
    gathered: list[Any] = [None] * ranks.world_size
    dist.all_gather_object(gathered, value)
    return sum(gathered) / len(gathered)


def gather(value: Any, ranks: Ranks) -> list[Any]:
    """Every rank's `value` (picklable), in rank order."""
    if not ranks.distributed:
        return [value]
    gathered: list[Any] = [None] * ranks.world_size
    dist.all_gather_object(gathered, value)
    return gathered


def from_main(value: Any, ranks: Ranks) -> Any:
    """Rank 0's `value`, on every rank (the run folder's name, which holds a time)."""
    if not ranks.distributed:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def bind_cores(ranks: Ranks) -> list[int]:
    """Coarse-grained core binding: this process's CPU affinity set to its share of the node's
    cores, contiguous blocks in local-rank order (the case study's coarse binding). Returns the
    cores."""
    cores = sorted(os.sched_getaffinity(0))
    share = max(1, len(cores) // ranks.local_world_size)
    mine = cores[ranks.local_rank * share:(ranks.local_rank + 1) * share] or cores[-share:]
    os.sched_setaffinity(0, mine)
    return mine


def launch(argv: Sequence[str], nproc: int) -> int:
    """Run `pi0align ARGV` as `nproc` processes on this node under torch.distributed.run
    (`--standalone`: a free port on this host), and wait; returns the launcher's exit code. The
    processes learn their count from the launcher: `--nproc` is left out of what they are given
    (torchrun's parser would take it for its own `--nproc-per-node`)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
               "-m", "pi0align.cli.main", *_without_nproc(argv)]
    return subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")},
                          check=False).returncode


def _without_nproc(argv: Sequence[str]) -> list[str]:
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            kept.append(arg)
    return kept


def ddp(policy: torch.nn.Module, device: Device) -> torch.nn.Module:
    """The policy in DistributedDataParallel (PI0 leaves some parameters unused: PaliGemma's
    language-model head)."""
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [device.index] if device.type in ("cuda", "npu") and device.index is not None else None
    return DistributedDataParallel(policy, device_ids=device_ids, find_unused_parameters=True)


class CommunicationClock:
    """Seconds a step's gradient all-reduces take, from each bucket's start to its result (they
    overlap the backward): DDP's default all-reduce hook, timed."""

    def __init__(self) -> None:
        self.seconds = 0.0

    @classmethod
    def attached_to(cls, model: torch.nn.Module) -> CommunicationClock:
        clock = cls()
        model.register_comm_hook(state=None, hook=clock._hook)
        return clock

    def _hook(self, state, bucket):  # no return annotation: DDP checks it, and a string would not pass
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        started = time.perf_counter()

        def done(future: torch.futures.Future) -> torch.Tensor:
            self.seconds += time.perf_counter() - started
            return future.value()

        return allreduce_hook(state, bucket).then(done)

    def take(self) -> float:
        """The seconds since the last take."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds
