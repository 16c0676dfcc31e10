"""Step time of PI0 training with the monitor (dump/monitoring/monitor.py), as a ratio to the same steps
without it: small preset, CPU (or --device), one CPU thread, plain and monitored steps alternating
in one process, each monitored step timed against the plain step just before it, `--pairs` times a
round, the round's ratio their median (as bench/dump_overhead.py, whose steps and alternation it
uses). A monitored step: the step with the monitor's hooks on (the gradients' norms handed over by
its clipping, as `pi0align run` does), its row computed, read back and handed to its writer
process. Putting the hooks on and taking them off, which a run does once, is not timed.
`--check` judges the goal (≤ 1.03×) and exits 1 when it is missed by more than its noise.

    .venv/bin/python bench/monitor_overhead.py [--device cpu] [--preset small] [--rounds 5] [--pairs 3] [--check]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

from dump_overhead import MALLOC_ENV, alternate, build
from goals import Goal, judge, print_check

GOAL = Goal(1.03)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--check", action="store_true", help="judge the goal; exit 1 when it is missed")
    args = parser.parse_args()
    if any(os.environ.get(k) != v for k, v in MALLOC_ENV.items()):  # the allocator's thresholds, as the dump bench
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **MALLOC_ENV})

    from pi0align.dump.monitoring.alerts import AlertRules
    from pi0align.dump.monitoring.monitor import Monitor
    from pi0align.train.loop import frozen_heap

    with tempfile.TemporaryDirectory() as work:
        policy, optimizer, step = build(args, Path(work) / "run")
        monitor = Monitor(Path(work) / "monitor", alerts=AlertRules(console=open(os.devnull, "w")))

        def monitored():
            step(monitor.after_backward)
            monitor.step()

        # the hooks on before each monitored step and off after it, untimed: a run puts them on once
        with frozen_heap():
            ratios = alternate(step, {"monitor": monitored}, args.rounds, args.pairs,
                               prepare={"monitor": lambda: monitor.start(policy, optimizer)},
                               settle={"monitor": monitor.stop})["monitor"]
        monitor.close()
        rows = monitor.current_step
    judged = judge("monitor, every module every step", ratios, GOAL)
    print(f"PI0 {args.preset} on {args.device}, 1 thread: {len(monitor.modules)} modules monitored, {rows} rows")
    rounds = ", ".join(f"{r:.3f}" for r in ratios)
    print(f"monitor: {statistics.median(ratios):.3f}× a step (± {judged.noise:.3f}; rounds {rounds})")
    return print_check([judged]) if args.check else 0


if __name__ == "__main__":
    sys.exit(main())
