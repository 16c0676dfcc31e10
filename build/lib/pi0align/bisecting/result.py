"""The result of a bisect, as plain data: what `report` renders and `--json` writes."""

from __future__ import annotations

from dataclasses import dataclass, field

from pi0align.bisecting.probes import Probe
from pi0align.compare.result import Culprit
from pi0align.runs.monitor import Leaving


@dataclass(frozen=True)
class Bound:
    """How far one step on this device from the reference's state may land from the reference's
    own step, per quantity (relative), and what measured it."""

    loss: float
    grad_norm: float
    measured_by: str

    def beyond(self, probe: Probe) -> bool:
        return probe.loss_difference > self.loss or probe.grad_norm_difference > self.grad_norm


@dataclass(frozen=True)
class Bisection:
    """Where the run under test first computes a step differently from the reference's state.

    `probes`: every one-step probe, in the order run; `searched`: the reference's checkpoints the
    search covered (up to where B first parts from A: its loss leaves A's band, `parts_at`, or,
    earlier, a module of its monitor, `first_module`; or all); `monitors`: what the two runs'
    monitors said;
    `first_checkpoint_beyond`: the first whose one-step difference is beyond `bound` (None: none
    is); `nondeterministic`: that step, run twice from the same state, differs (the culprit is
    then the first call that differs, evidence `exact`); `culprit`: the call named (by `compare`
    against the reference's dump of that step, or by `audit`: `judged_by`); `commands`: what to run
    on the reference's device for its side of that step."""

    reference: str
    under_test: str
    probes: list[Probe]
    bound: Bound
    searched: list[int]
    parts_at: int | None
    first_checkpoint_beyond: int | None
    first_module: Leaving | None = None
    monitors: str = ""
    nondeterministic: bool = False
    culprit: Culprit | None = None
    judged_by: str = ""
    commands: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        """"computes differently" where a checkpoint is beyond the bound, else "rounding"."""
        return "rounding" if self.first_checkpoint_beyond is None else "computes differently"
