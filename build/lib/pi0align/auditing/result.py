"""The result of auditing one run, as plain data: what `report` renders and `bisect` reads."""

from __future__ import annotations

from dataclasses import dataclass, field

from pi0align.auditing.nonfinite import EdgeValue
from pi0align.compare.result import Culprit, CulpritGroup


@dataclass(frozen=True)
class Audit:
    """One dump judged alone: `culprits`, the origin of the first NaN/Inf of each rank first
    (evidence `nonfinite`), then the calls whose local error is beyond their standard and stands
    out (evidence `standard`), in execution order; their groups; the results near their dtype's
    largest value (`edges`); how many calls were held to their standard (`replayed`), and why the
    others were not (`not_replayed`: reason -> count)."""

    source: str
    mode: str  # "stats" | "sample" | "tensor"
    culprits: list[Culprit]
    culprit_groups: list[CulpritGroup] = field(default_factory=list)
    edges: list[EdgeValue] = field(default_factory=list)
    replayed: int = 0
    not_replayed: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        """"pass": nothing beyond its standard and no NaN/Inf made; "fail" otherwise."""
        return "fail" if self.culprits else "pass"

    @property
    def nonfinite(self) -> list[Culprit]:
        """The origins of NaN/Inf: the first of each rank."""
        return [c for c in self.culprits if c.evidence == "nonfinite"]
