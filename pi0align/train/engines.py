"""Who reduces the gradients and steps the parameters (`run --engine`), chosen once per run:

- `torch`: the policy itself in one process, in torch's DistributedDataParallel in several;
- `deepspeed`: DeepSpeed's engine with a ZeRO stage (`--zero-stage`), where DeepSpeed is installed.

Both take the same components (policy, optimizer, scheduler, clipping norm) and train the same
step: forward and backward of a batch, then clipping, the optimizer and the schedule. Checkpoints
keep one layout (train/checkpoint.py): the optimizer's state is torch's own, or DeepSpeed's
partitioned files in the checkpoint's `deepspeed/` folder.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from pathlib import Path

import torch

from pi0align.clipping import GradientNorms, clip_gradients
from pi0align.errors import UserError
from pi0align.train import checkpoint, distributed

ENGINES = ("torch", "deepspeed")
DEEPSPEED_TAG = "deepspeed"  # the folder of DeepSpeed's own files in a checkpoint


def check_available(engine: str) -> None:
    """One line where the engine's library is missing (before any process is launched)."""
    if engine == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        raise UserError("--engine deepspeed: DeepSpeed is not installed (pip install deepspeed, "
                        "or scripts/install.sh scale)")


def build(engine: str, *, policy, optimizer, scheduler, grad_clip_norm: float, batch_size: int, zero_stage: int,
          ranks: distributed.Ranks, device):
    engines = {"torch": TorchEngine, "deepspeed": DeepSpeedEngine}
    return engines[engine](policy=policy, optimizer=optimizer, scheduler=scheduler, grad_clip_norm=grad_clip_norm,
                           batch_size=batch_size, zero_stage=zero_stage, ranks=ranks, device=device)


def forward(model, batch) -> torch.Tensor:
    model.train()
    loss, _ = model(batch)
    return loss


class TorchEngine:
    """The policy in DDP when there are several ranks (gradients all-reduced as backward runs, the
    reductions timed), bare otherwise."""

    def __init__(self, *, policy, optimizer, scheduler, grad_clip_norm, batch_size, zero_stage, ranks, device):
        self.policy, self.optimizer, self.scheduler, self.grad_clip_norm = policy, optimizer, scheduler, grad_clip_norm
        self.ranks, self.device = ranks, device
        self.model = distributed.ddp(policy, device) if ranks.distributed else policy
        self._clock = distributed.CommunicationClock.attached_to(self.model) if ranks.distributed else None
        self.dumped_optimizer = optimizer  # its step hooks see every parameter by name

    def forward_backward(self, batch) -> float:
        loss = forward(self.model, batch)
        loss.backward()
        return loss.item()

    def step(self, after_backward: Callable[[GradientNorms | None], None] | None = None) -> float:
        """Clip the gradients, step the optimizer and the schedule; returns the norm before clipping.
        `after_backward(norms)`: called before the gradients are scaled, with each one's norm as the
        clip computed it (clipping.clip_gradients)."""
        grad_norm = clip_gradients(self.policy.parameters(), self.grad_clip_norm, after_backward)
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.scheduler.step()
        return grad_norm.item()

    def communication_seconds(self) -> float | None:
        return self._clock.take() if self._clock is not None else 0.0

    def save(self, run_dir: Path, steps_done: int, config, rng: list[dict]) -> None:
        if self.ranks.main:
            checkpoint.save(run_dir, steps_done, policy=self.policy, optimizer=self.optimizer,
                            scheduler=self.scheduler, config=config, rng=rng)

    def restore(self, source: Path) -> int:
        return checkpoint.restore(source, policy=self.policy, optimizer=self.optimizer, scheduler=self.scheduler,
                                  device=self.device, rank=self.ranks.rank)


class DeepSpeedEngine:
    """DeepSpeed's engine over the same policy, optimizer and schedule: its `gradient_clipping` at
    the preset's norm, one micro-batch a step, ZeRO at `zero_stage`. Under ZeRO 1 to 3 the
    optimizer steps flat partitions that no parameter name reaches: the dump records the modules'
    calls and parameters as the forward sees them (gathered), not the optimizer's update."""

    def __init__(self, *, policy, optimizer, scheduler, grad_clip_norm, batch_size, zero_stage, ranks, device):
        os.environ.setdefault("DS_ACCELERATOR", device.type)  # never a guess from what is installed
        import deepspeed

        self.policy, self.scheduler, self.ranks, self.device = policy, scheduler, ranks, device
        # without ZeRO, DeepSpeed clips as torch does but keeps the norm to itself: we clip there
        self._clip_norm = grad_clip_norm if zero_stage == 0 else None
        settings = {"train_micro_batch_size_per_gpu": batch_size, "gradient_accumulation_steps": 1,
                    "gradient_clipping": 0.0 if zero_stage == 0 else grad_clip_norm,
                    "zero_optimization": {"stage": zero_stage},
                    "steps_per_print": 2**31 - 1}
        os.environ.setdefault("LOCAL_RANK", str(ranks.local_rank))  # DeepSpeed asks it of one process too
        distributed.start_alone(device)  # one process: its own group (several: already joined)
        self.model, self.optimizer, _, _ = deepspeed.initialize(model=policy, optimizer=optimizer,
                                                                lr_scheduler=scheduler, config=settings)
        self.dumped_optimizer = optimizer if zero_stage == 0 else None

    def forward_backward(self, batch) -> float:
        loss = forward(self.model, batch)
        self.model.backward(loss)
        return loss.item()

    def step(self, after_backward: Callable[[GradientNorms | None], None] | None = None) -> float:
        """DeepSpeed's step: clipping, the optimizer, zeroing the gradients, the schedule;
        `after_backward` as TorchEngine.step's (under ZeRO, DeepSpeed clips: called with None)."""
        if self._clip_norm is None:
            if after_backward is not None:
                after_backward(None)
            self.model.step()
            return float(self.model.get_global_grad_norm())
        grad_norm = clip_gradients(self.policy.parameters(), self._clip_norm, after_backward)
        self.model.step()
        return grad_norm.item()

    def communication_seconds(self) -> float | None:
        return None  # inside DeepSpeed's engine; its own comms logger measures it

    def save(self, run_dir: Path, steps_done: int, config, rng: list[dict]) -> None:
        """DeepSpeed's files (every rank writes its partition), then ours beside them on rank 0."""
        staging = checkpoint.staging_dir(run_dir, steps_done)
        self.model.save_checkpoint(str(staging), tag=DEEPSPEED_TAG)
        if self.ranks.main:
            checkpoint.save(run_dir, steps_done, policy=self.policy, optimizer=self.optimizer, scheduler=self.scheduler,
                            config=config, rng=rng, staged=True)
        torch.distributed.barrier()

    def restore(self, source: Path) -> int:
        if not (source / DEEPSPEED_TAG).is_dir():
            raise UserError(f"{source} was not written by --engine deepspeed: resume it with --engine torch")
        self.model.load_checkpoint(str(source), tag=DEEPSPEED_TAG)
        return checkpoint.restore(source, policy=None, optimizer=None, scheduler=None, device=self.device,
                                  rank=self.ranks.rank)
