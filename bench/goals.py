"""The speed goals a bench script checks with `--check` (issue: "speed back under its goals and kept
there"): each measured over rounds, judged by its median, with the run-to-run noise it measured
(half the range over the rounds) as the margin. A goal is missed when the median is past the limit
by more than that noise; then the script exits 1."""

from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class Goal:
    limit: float
    higher_is_better: bool = False  # a throughput, or a speed-up over msprobe; else a cost ratio
    unit: str = "×"


@dataclass(frozen=True)
class Judged:
    name: str
    goal: Goal
    median: float
    noise: float  # half the range of the rounds' values

    @property
    def past(self) -> float:
        """How far the median is past the limit (<= 0: within it)."""
        return self.goal.limit - self.median if self.goal.higher_is_better else self.median - self.goal.limit

    def __bool__(self) -> bool:
        return self.past <= self.noise

    @property
    def result(self) -> str:
        """`met`; `within noise` (past the limit by no more than the noise); `MISSED`."""
        return "met" if self.past <= 0 else "within noise" if self else "MISSED"


def judge(name: str, values: list[float], goal: Goal) -> Judged:
    return Judged(name, goal, statistics.median(values), (max(values) - min(values)) / 2)


def print_check(judged: list[Judged]) -> int:
    """The goals' table; 0 when every goal is met (within its noise), else 1."""
    print(f"{'goal':<44} {'median':>9} {'± noise':>9} {'limit':>10}  result")
    for j in judged:
        sign = "≥" if j.goal.higher_is_better else "≤"
        print(f"{j.name:<44} {j.median:>8.3f}{j.goal.unit} {j.noise:>8.3f}{j.goal.unit} "
              f"{sign}{j.goal.limit:>8.2f}{j.goal.unit}  {j.result}")
    missed = [j.name for j in judged if not j]
    print("every goal met (within its noise)" if not missed else f"missed: {', '.join(missed)}")
    return 1 if missed else 0
