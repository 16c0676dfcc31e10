"""Load: a long run dumping statistics every Nth step, and compares of its dump; is memory flat?

    .venv/bin/python bench/load.py [--steps 1000] [--every 10] [--preset tiny] [--out DIR]

Runs `pi0align run` (the given preset, batch 4, one thread) for --steps steps with a statistics
dump at every --every-th step, samples the resident memory of the training process and of its dump
writer (from /proc) as the steps go by, and prints it at each tenth of the run with the growth from
the first tenth to the last. Then compares the dump against itself three times, on its first tenth
of dumped steps, its first half and all of them, each in a fresh process, and prints their time and
peak resident memory: past one window of steps (compare/windows.py, ROWS_PER_WINDOW records), a
compare's memory must not grow with the number of steps (docs/reliability.md).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pi0align.compare.windows import ROWS_PER_WINDOW

ROOT = Path(__file__).resolve().parents[1]
# the compare's own peak, VmHWM (ru_maxrss would carry over this forking process's); its rows are
# counted from disk, a part at a time (reading them whole would be the memory measured)
COMPARE = """
import sys, time
from pi0align.compare import compare_dumps
steps = range(int(sys.argv[2])) if sys.argv[2] != "all" else None
started = time.perf_counter()
result = compare_dumps(sys.argv[1], sys.argv[1], steps=steps)
seconds = time.perf_counter() - started
peak_kib = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM"))
print(result.verdict, sum(len(part) for part in result.row_parts(["step"])), seconds, peak_kib)
"""


def rss_mib(pid: int) -> float:
    """The process's private resident memory (RssAnon): the dump's ring buffer, shared by the two
    processes, is left out; it is counted in the writer as its pages are first read, up to its size."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def steps_done(log: Path) -> int:
    try:
        return log.read_text().count("\n")
    except OSError:
        return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="pi0align-load-")) / "run"
    dumped = ",".join(str(s) for s in range(0, args.steps, args.every))
    run = subprocess.Popen([sys.executable, "-m", "pi0align.cli.main", "run", "--preset", args.preset, "--batch-size",
                            "4", "--threads", "1", "--steps", str(args.steps), "--dump-steps", dumped, "--no-progress",
                            "--log-every", "0", "--out", str(out)], cwd=ROOT, stdout=subprocess.DEVNULL,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    samples = []  # (steps done, training RSS, writer RSS)
    started = time.perf_counter()
    while run.poll() is None:
        done = steps_done(out / "train_log.jsonl")
        writers = children(run.pid)
        sample = (done, rss_mib(run.pid), sum(rss_mib(p) for p in writers))
        if done and writers and all(v == v for v in sample):  # not NaN: the processes were still there
            samples.append(sample)
        time.sleep(0.5)
    if run.returncode != 0:
        sys.exit(f"the run failed (exit {run.returncode})")
    print(f"{args.steps} steps of the {args.preset} preset, statistics dumped every {args.every}th step, "
          f"in {time.perf_counter() - started:.0f} s ({out})")
    print(f"{'steps done':>10} {'training private RSS MiB':>25} {'writer private RSS MiB':>23}")
    tenths = []
    for tenth in range(1, 11):
        at = [s for s in samples if s[0] <= tenth * args.steps / 10]
        if at:
            tenths.append(at[-1])
            print(f"{at[-1][0]:>10} {at[-1][1]:>25.0f} {at[-1][2]:>23.0f}")
    first, last = tenths[0], tenths[-1]
    print(f"growth from step {first[0]} to step {last[0]}: training {last[1] - first[1]:+.0f} MiB, "
          f"writer {last[2] - first[2]:+.0f} MiB")
    dump = out / "dump.h5"
    print(f"dump: {dump.stat().st_size / 2**20:.1f} MiB, {len(range(0, args.steps, args.every))} dumped steps")
    print(f"a compare judges windows of steps holding about {ROWS_PER_WINDOW:,} records")
    for label, steps in (("first tenth", str(args.steps // 10)), ("first half", str(args.steps // 2)),
                         ("all steps", "all")):
        done = subprocess.run([sys.executable, "-c", COMPARE, str(dump), steps], cwd=ROOT, capture_output=True,
                              text=True, check=True)
        verdict, rows, seconds, max_rss_kib = done.stdout.split()
        print(f"compare of the dump with itself, {label:>11}: {verdict}, {int(rows):>8} rows in "
              f"{float(seconds):6.1f} s, peak RSS {int(max_rss_kib) / 1024:6.0f} MiB")


if __name__ == "__main__":
    main()
