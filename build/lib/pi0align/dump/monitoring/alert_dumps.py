"""`pi0align run --dump-on-alert`: the step after a monitor's alert dumped (stats, the Dumper's
defaults) into `<out>/alerts/<step>/`, unless the run's own dumper dumps it; at most LIMIT steps a
run (a run gone wrong alerts again as the trouble spreads: the first dumps are the evidence)."""

from __future__ import annotations

import sys
from pathlib import Path

LIMIT = 8


class AlertDumps:
    """The dumps scheduled by alerts: `schedule(step)` after an alert, `take(step)` the Dumper of a
    step about to run (None: none), `finish(step)` once it ran."""

    def __init__(self, out: Path, dumper=None) -> None:
        self.out, self.dumper = Path(out), dumper
        self.pending: dict[int, object] = {}
        self.scheduled = 0

    def schedule(self, step: int) -> None:
        if step in self.pending or (self.dumper is not None and self.dumper.dumps(step)):
            return
        if self.scheduled == LIMIT:
            print(f"pi0align monitor: --dump-on-alert has dumped {LIMIT} steps: no more in this run", file=sys.stderr)
        self.scheduled += 1
        if self.scheduled > LIMIT:
            return
        from pi0align.dump import Dumper

        self.pending[step] = Dumper(self.out / "alerts" / f"{step:06d}", steps=[step])

    def take(self, step: int):
        return self.pending.get(step)

    def finish(self, step: int) -> None:
        done = self.pending.pop(step, None)
        if done is not None:
            done.close()
