"""Alerts while a run goes on (docs/monitor-format.md): a monitored quantity that is NaN or Inf,
or that jumps past TURBULENCE × its recent mean, each a row of `alerts.jsonl` beside the monitor
file, and a step's alerts one line on the console at once, naming the first the step computed
(where it started: a NaN spreads to every module after it, and its gradients to every one).
msprobe's monitor rules: `AnomalyNan`, and `AnomalyTurbulence` (|value| > (1 + threshold) × the
moving mean of |value|, β = 0.99). Imports neither torch nor the rest of pi0align but the
monitor's format."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from pi0align.dump.monitoring.monitor_file import QUANTITIES, computed_order

# A jump: |value| past this many times its moving mean (msprobe's 1 + threshold). PI0 small and tiny
# trained 50 steps go up to 3.4× and 3.9× (the gradients' norms of the action head in the first
# steps, as the learning rate warms up): an order of magnitude leaves them quiet.
TURBULENCE = 10.0
BETA = 0.99  # the moving mean's weight of its past (msprobe's)
WARMUP = 5  # steps of a quantity's history before a jump is judged: its mean is its first value until then
# the quantities a jump is judged on: those a healthy run keeps about steady (Adam's moments grow
# from zero over their first 10 and 1,000 steps, and the parameters drift: judged as NaN/Inf only)
JUMPING = frozenset({"output_norm", "output_max", "grad_norm", "update_norm"})


@dataclass(frozen=True)
class Alert:
    step: int
    module: str
    quantity: str
    value: float
    rule: str  # "nonfinite" | "turbulence"
    mean: float | None = None  # the moving mean a jump was judged against


class AlertRules:
    """The rules, with each (module, quantity)'s moving mean; `open` gives them the alerts file."""

    def __init__(self, turbulence: float = TURBULENCE, warmup: int = WARMUP, console=sys.stderr) -> None:
        self.turbulence, self.warmup, self.console = turbulence, warmup, console
        self._means: np.ndarray | None = None
        self._held: np.ndarray | None = None  # where a rule held at the previous step: no alert again
        self._seen = 0
        self._path: Path | None = None

    def open(self, path: Path) -> None:
        self._path = path

    def check(self, step: int, modules: list[str], values: np.ndarray, present: np.ndarray) -> list[Alert]:
        """One step's row (modules, in the order they ran, × QUANTITIES) and where a module has each
        quantity: its alerts, in the order the step computed them, printed and written at once. A
        quantity alerts at the step a rule starts to hold for it, not again while it holds (a NaN
        that stays is one alert)."""
        magnitude = np.abs(values.astype(np.float64))
        if self._means is None:
            self._means = magnitude.copy()
        counts = [QUANTITIES.index(q) for q in QUANTITIES if q.endswith("_nonfinite")]
        nonfinite = present & ~np.isfinite(values)
        with np.errstate(invalid="ignore"):
            nonfinite[:, counts] |= values[:, counts] > 0
        judged = np.array([q in JUMPING for q in QUANTITIES])
        with np.errstate(invalid="ignore"):
            jumps = judged & np.isfinite(magnitude) & (magnitude > self.turbulence * self._means) & (self._means > 0)
        if self._seen < self.warmup:
            jumps[:] = False
        jumps &= ~nonfinite
        held = np.stack((nonfinite, jumps))
        new = held & ~self._held if self._held is not None and self._held.shape == held.shape else held
        self._held = held
        found = [(m, q, "nonfinite", None) for m, q in zip(*np.nonzero(new[0]))]
        found += [(m, q, "turbulence", float(self._means[m, q])) for m, q in zip(*np.nonzero(new[1]))]
        found.sort(key=lambda alert: computed_order(int(alert[0]), QUANTITIES[alert[1]]))
        alerts = [Alert(step, modules[m], QUANTITIES[q], float(values[m, q]), rule, mean) for m, q, rule, mean in found]
        finite = np.isfinite(magnitude)
        self._means = np.where(finite & np.isfinite(self._means), BETA * self._means + (1 - BETA) * magnitude,
                               np.where(finite, magnitude, self._means))
        self._seen += 1
        self._report(alerts)
        return alerts

    def _report(self, alerts: list[Alert]) -> None:
        if not alerts:
            return
        first = alerts[0]
        why = "is NaN or holds NaN/Inf" if first.rule == "nonfinite" else \
            f"jumped to {first.value:.4g}, past {self.turbulence:g} × its recent mean {first.mean:.4g}"
        more = f" (and {len(alerts) - 1} more after it{': ' + str(self._path) if self._path else ''})" \
            if len(alerts) > 1 else ""
        print(f"pi0align monitor: step {first.step}: {first.module} {first.quantity} {why}{more}", file=self.console)
        if self._path is not None:
            with self._path.open("a", encoding="utf-8") as rows:
                for alert in alerts:
                    rows.write(json.dumps({k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                                           for k, v in asdict(alert).items()}) + "\n")
