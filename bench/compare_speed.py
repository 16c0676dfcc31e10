"""Speed of `pi0align compare` against msprobe's `msprobe compare`, measured side by side.

    .venv/bin/python bench/compare_speed.py [--calls 1000,5000,20000] [--tensor-gb 1] [--quick] [--check [--rounds 3]]

1. the same msprobe dumps (statistics and tensor) of a small torch MLP made with msprobe's
   PrecisionDebugger on CPU: both tools as command-line processes (start-up included);
2. synthetic msprobe statistics dumps of 1k, 5k and 20k calls (identical call sequences);
   in cases 1 and 2 ours runs three ways: compare_dumps in a bare process, and the `pi0align
   compare` command as a user runs it (console summary, with its HTML report and with --no-html);
3. sequence alignment: 20k calls where run B has 1% extra calls (casts) -- ours against
   msprobe's fuzzy mode (-fm);
4. tensor mode on our HDF5 dumps: throughput (GB/s of tensor data, compare_dumps timed inside its
   process; the time with the process's start beside it) and peak resident memory;
5. replay: two tensor-dumped steps of real PI0 small (bf16, 1 against 2 threads; one with
   --quick) compared with every call replayed in float64, as a ratio to the same compare without
   replay (goal <= 2x), and the peak resident memory of both (goal <= 1.5 GiB).

Prints one line per case with both times, each with its peak resident memory, and the ratio.
Needs mindstudio-probe for cases 1-3 (skipped with a line when absent). `--check` measures the
goals' cases --rounds times (tensor mode without replay ≥ 1.5 GiB/s per side; msprobe ÷ ours,
CLI without HTML, ≥ 10× on its tensor dumps, where both replay nothing, and ≥ 20× on its
statistics dumps of case 1; the tensor dumps' CLI with replay is printed beside; on the largest
synthetic pair of case 2, msprobe ÷ ours ≥ 30× in process and ≥ 20× through the CLI), prints
each median with its noise (half the range over the rounds) and exits 1 when a goal is missed by
more than that noise (bench/goals.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
from goals import Goal, judge, print_check

ROOT = Path(__file__).resolve().parents[1]

PYTHON = sys.executable
MSPROBE = shutil.which("msprobe", path=str(Path(PYTHON).parent)) or shutil.which("msprobe")
PI0ALIGN = shutil.which("pi0align", path=str(Path(PYTHON).parent))  # the console script, as installed
TIMEOUT = 600

# ours as a bare process: start-up and compare_dumps, no report (ours_cli runs the command itself)
# it prints compare_dumps' own time first: the process's start (imports) is a fixed cost apart
OURS = ("import sys, time; from pi0align.compare import compare_dumps; started = time.perf_counter(); "
        "r = compare_dumps(sys.argv[1], sys.argv[2], replay=sys.argv[3] == 'replay'); "
        "print(f'{time.perf_counter() - started:.3f} s', r.verdict, r.coverage)")
TENSOR_GOAL = "tensor mode, no replay: GiB/s per side"
SYNTHETIC_IN_PROCESS = "msprobe ÷ ours, largest synthetic, in process"
SYNTHETIC_CLI = "msprobe ÷ ours, largest synthetic, CLI"
GOALS = {TENSOR_GOAL: Goal(1.5, higher_is_better=True, unit=""),
         "msprobe ÷ ours, its tensor dumps, CLI": Goal(10.0, higher_is_better=True),  # without replay
         "msprobe ÷ ours, its statistics dumps, CLI": Goal(20.0, higher_is_better=True),
         # the largest synthetic pair, where the start-up no longer matters: the compare itself
         SYNTHETIC_IN_PROCESS: Goal(30.0, higher_is_better=True),
         SYNTHETIC_CLI: Goal(20.0, higher_is_better=True)}
MEASURED: dict[str, list[float]] = {name: [] for name in GOALS}  # a value per round


class Timed(NamedTuple):
    seconds: float
    said: str  # its stdout, or its last error line when it failed
    peak_gib: float  # its peak resident memory (VmHWM)


def timed(command: list[str], timeout: int = TIMEOUT) -> Timed:
    """Wall time up to the process's exit (a blocking wait: a poll would round a 0.3 s run up by
    half its interval on average), what the process said, and its peak resident memory: VmHWM
    sampled by a thread while it runs (ru_maxrss would carry over the forking parent's, here the
    process that wrote the dumps)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        process = subprocess.Popen(command, stdout=out, stderr=err, text=True)
        peak, ended = [0], threading.Event()

        def watch() -> None:  # the memory, and the time limit
            while not ended.wait(0.02):
                peak[0] = max(peak[0], _high_water_kb(process.pid))
                if time.perf_counter() - start > timeout:
                    process.kill()

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        process.wait()
        elapsed = time.perf_counter() - start
        ended.set()
        watcher.join()
        peak_gib = peak[0] / 2**20
        if elapsed > timeout:
            return Timed(float("inf"), f"timeout after {timeout} s", peak_gib)
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    if process.returncode in (0, 1) and "Traceback" not in stderr:
        return Timed(elapsed, stdout.strip(), peak_gib)
    errors = [line for line in (stdout + stderr).splitlines() if "[ERROR]" in line or "Error" in line]
    return Timed(elapsed, f"failed (exit {process.returncode}): {(errors or ['?'])[-1].strip()[-120:]}", peak_gib)


def _high_water_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as status:
            return next((int(line.split()[1]) for line in status if line.startswith("VmHWM")), 0)
    except OSError:  # ended between poll() and here
        return 0


def ours(a: Path, b: Path, replay: bool = True) -> Timed:
    return timed([PYTHON, "-c", OURS, str(a), str(b), "replay" if replay else "no-replay"])


def ours_cli(a: Path, b: Path, html: Path | None, replay: bool = True) -> Timed:
    """`pi0align compare A B` as a user types it: the console summary, and the HTML report at
    `html` (None: --no-html); not `replay`: --no-replay. `said` is the verdict it printed."""
    command = [PI0ALIGN] if PI0ALIGN else [PYTHON, "-m", "pi0align.cli.main"]
    outputs = (["--html", str(html)] if html else ["--no-html"]) + ([] if replay else ["--no-replay"])
    run = timed(command + ["compare", str(a), str(b), *outputs])
    return run._replace(said=next((word for word in ("ALIGNED", "DIVERGED") if word in run.said), run.said[-120:]))


def ours_in_process(a: Path, b: Path) -> float:
    from pi0align.compare import compare_dumps

    start = time.perf_counter()
    compare_dumps(a, b)
    return time.perf_counter() - start


def alignment_alone(a: Path, b: Path) -> float:
    """Seconds to pair the records of two already-read dumps (the alignment step by itself)."""
    from pi0align.compare.measuring.align import pair_records
    from pi0align.compare.reading.open_dump import open_run

    (dump_a,), (dump_b,) = open_run(a).values(), open_run(b).values()
    start = time.perf_counter()
    pair_records(dump_a.records, dump_b.records)
    return time.perf_counter() - start


def msprobe(a_step: Path, b_step: Path, out: Path, fuzzy: bool = False) -> Timed:
    command = [MSPROBE, "compare", "--target_path", str(b_step), "--golden_path", str(a_step),
               "--output_path", str(out)] + (["-fm"] if fuzzy else [])
    run = timed(command)
    return run if run.said.startswith(("failed", "timeout")) else run._replace(said=msprobe_summary(out))


def msprobe_summary(out: Path) -> str:
    """Rows and share of rows msprobe passed, from the CSV it wrote."""
    import csv

    files = sorted(out.glob("compare_result*.csv"))
    if not files:
        return "no result file"
    with open(files[-1], newline="", encoding="utf-8") as handle:
        results = [row.get("Result", "") for row in csv.DictReader(handle)]
    passed = sum(r.lower() == "pass" for r in results)
    return f"{len(results)} rows, {passed / max(len(results), 1):.1%} pass"


def line(case: str, ours_run: Timed, theirs_run: Timed, extra: str = "") -> None:
    """One case: both times, each with its peak resident memory, and the ratio of the times."""
    ratio = theirs_run.seconds / ours_run.seconds if ours_run.seconds > 0 else float("nan")
    print(f"{case:<52} ours {ours_run.seconds:7.2f} s {ours_run.peak_gib:5.2f} GiB   "
          f"msprobe {theirs_run.seconds:7.2f} s {theirs_run.peak_gib:5.2f} GiB   msprobe/ours {ratio:6.1f}x  {extra}",
          flush=True)


# --- synthetic msprobe statistics dumps --------------------------------------------------------

APIS = [("Functional.linear", 3), ("Torch.matmul", 2), ("Functional.softmax", 1), ("Tensor.__add__", 2),
        ("Functional.gelu", 1), ("Tensor.view", 1), ("Functional.layer_norm", 3), ("Tensor.__mul__", 2)]


def _base(rng: random.Random, shape: list[int]) -> dict:
    scale = rng.uniform(0.1, 3.0)
    return {"Max": 3 * scale, "Min": -3 * scale, "Mean": rng.uniform(-0.1, 0.1) * scale,
            "Norm": scale * float(np.sqrt(np.prod(shape)))}


def _stats(rng: random.Random, shape: list[int], jitter: float, base: dict) -> dict:
    return {"type": "torch.Tensor", "dtype": "torch.float32", "shape": shape, "requires_grad": False,
            **{k: v * (1 + jitter * rng.gauss(0, 1)) for k, v in base.items()}}


def write_synthetic_msprobe(folder: Path, calls: int, *, seed: int, extra_every: int = 0) -> Path:
    """step0/rank0/{dump,stack,construct}.json with `calls` forward calls in modules of 8 calls;
    the same structure and statistics for every seed, up to float32-like noise. extra_every > 0
    inserts one extra `Tensor.to` cast after every extra_every-th call (msprobe's per-API counter
    of every later cast then shifts)."""
    structure, noise = random.Random(0), random.Random(seed)
    data, construct, stack, counters = {}, {}, {}, {}

    def add(api: str, module: str, inputs: int, shape: list[int], base: list[dict] | None = None) -> None:
        k = counters.get(api, 0)
        counters[api] = k + 1
        key = f"{api}.{k}.forward"
        data[key] = {"input_args": [_stats(noise, shape, 1e-7, b) for b in base[:inputs]],
                     "input_kwargs": {}, "output": [_stats(noise, shape, 1e-7, base[-1])]}
        construct[key] = f"Module.{module}.Block.forward.0"
        stack[str(len(stack))] = [[key], [f"File /src/model.py, line {10 + len(stack) % 50}, in forward, \n x"]]

    for i in range(calls):
        api, inputs = APIS[structure.randrange(len(APIS))]
        shape = [8, 64 * structure.randint(1, 4)]
        base = [_base(structure, shape) for _ in range(inputs + 1)]
        add(api, f"model.layers.{i // 8}", inputs, shape, base)
        if extra_every and i % extra_every == extra_every - 1:
            add("Tensor.to", f"model.layers.{i // 8}", 1, shape, base[-1:] * 2)
    rank = folder / "step0" / "rank0"
    rank.mkdir(parents=True, exist_ok=True)
    (rank / "dump.json").write_text(json.dumps({"task": "statistics", "level": "L1", "framework": "pytorch",
                                                "dump_data_dir": None, "data": data}))
    (rank / "construct.json").write_text(json.dumps(construct))
    (rank / "stack.json").write_text(json.dumps(stack))
    return folder


# --- tensor mode on our dumps ----------------------------------------------------------------

def write_big_dump(path: Path, gigabytes: float, seed: int) -> int:
    """A pi0align tensor dump of float32 tensors of 64 MiB each, `gigabytes` in all, written with
    pi0align.testing.dumpfactory (the writer the tests use). Returns the tensor bytes."""
    from pi0align.testing.dumpfactory import Call, Step, write_dump

    elements = 1 << 24  # 64 MiB of float32
    count = max(1, round(gigabytes * (1 << 30) / (elements * 4)))
    rng = np.random.default_rng(0)
    noise = np.random.default_rng(seed)
    calls = []
    for i in range(count):
        value = rng.standard_normal((1 << 12, 1 << 12), dtype=np.float32)
        value *= 1 + np.float32(1e-7) * noise.standard_normal(value.shape, dtype=np.float32)
        calls.append(Call(f"model.layers.{i}/Functional.linear#0", f"model.layers.{i}", "Functional.linear",
                          "forward", [("output", 0, value)]))
    write_dump(path, [Step(0, calls, 0.0, 0.0, 0.0)], mode="tensor")
    return count * elements * 4


def tensor_throughput(work: Path, gigabytes: float, rounds: int) -> None:
    a, b = work / "big_a.h5", work / "big_b.h5"
    start = time.perf_counter()
    size = write_big_dump(a, gigabytes, 1)
    write_big_dump(b, gigabytes, 2)
    print(f"tensor mode: wrote 2 dumps of {size / 2**30:.2f} GiB tensor data each in "
          f"{time.perf_counter() - start:.0f} s", flush=True)
    for _ in range(rounds):
        for replay in (False, True):
            run = ours(a, b, replay)
            seconds = _printed_seconds(run.said)
            if not replay:
                MEASURED[TENSOR_GOAL].append(size / 2**30 / seconds)
            print(f"tensor mode, {'with' if replay else 'no'} replay: compared 2 x {size / 2**30:.2f} GiB in "
                  f"{seconds:.2f} s ({run.seconds:.2f} s with the process's start): {size / 2**30 / seconds:.2f} "
                  f"GiB/s per side ({2 * size / 2**30 / seconds:.2f} GiB/s both sides read), peak RSS "
                  f"{run.peak_gib:.2f} GiB", flush=True)


def _printed_seconds(said: str) -> float:
    """The time a compare printed first; infinite where it printed none (it failed or timed out)."""
    try:
        return float(said.split()[0])
    except (IndexError, ValueError):
        return float("inf")


def replay_cost(work: Path, rounds: int, steps: int) -> None:
    """compare_dumps with and without replay on tensor-dumped PI0 small steps, alternating; the
    peak resident memory of each (goal: 1.5 GiB at most for 2 steps, the replay within 2x)."""
    script = ("import sys; from pi0align.compare import compare_dumps; "
              "r = compare_dumps(sys.argv[1], sys.argv[2], replay=sys.argv[3] == 'on'); "
              "print(r.verdict, r.noise_model, len(r.culprits), 'culprits')")
    runs = []
    for threads in (1, 2):  # each in a process of its own: the thread count is the process's
        path = work / f"pi0_threads{threads}"
        make = (f"from pi0align.testing.scenarios import Pi0Run, dump_pi0; "
                f"dump_pi0({str(path)!r}, Pi0Run(threads={threads}, steps={steps}))")
        subprocess.run([PYTHON, "-c", make], check=True, capture_output=True, timeout=TIMEOUT)
        runs.append(str(path))
    done: dict[str, list[Timed]] = {"off": [], "on": []}
    for _ in range(rounds):
        for mode in done:
            done[mode].append(timed([PYTHON, "-c", script, *runs, mode]))
    off, on = (min(done[mode], key=lambda run: run.seconds) for mode in ("off", "on"))
    size = sum(f.stat().st_size for f in Path(runs[0]).rglob("*.h5*")) / 2**20
    print(f"replay: PI0 small, {steps} tensor-dumped steps ({size:.0f} MiB a side), bf16, 1 vs 2 threads: "
          f"{on.seconds:.1f} s {on.peak_gib:.2f} GiB with replay, {off.seconds:.1f} s {off.peak_gib:.2f} GiB without: "
          f"{on.seconds / off.seconds:.2f}x (goal <= 2x, peak <= 1.5 GiB; best of {rounds} alternating rounds each; "
          f"with replay: {on.said}; without: {off.said})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", default="1000,5000,20000")
    parser.add_argument("--tensor-gb", type=float, default=1.0, help="tensor data per dump (default 1 GiB)")
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument("--tensor-only", action="store_true", help="only the tensor-mode throughput case")
    parser.add_argument("--replay-only", action="store_true", help="only the replay case")
    parser.add_argument("--check", action="store_true", help="judge the goals; exit 1 when one is missed")
    parser.add_argument("--rounds", type=int, default=3, help="with --check: rounds of the goals' cases")
    args = parser.parse_args()
    rounds = args.rounds if args.check else 1
    sizes = [int(n) for n in args.calls.split(",")] if not args.quick else [1000]
    # pi0align's modules compiled, as an installed package is (pip compiles them; msprobe's are):
    # an editable install under PYTHONDONTWRITEBYTECODE would compile every module at each start
    subprocess.run([PYTHON, "-m", "compileall", "-q", str(ROOT / "pi0align")], check=True)
    work = Path(tempfile.mkdtemp(prefix="compare_speed_"))
    try:
        if args.replay_only:
            replay_cost(work, 1 if args.quick else 2, 1 if args.quick else 2)
            return
        if MSPROBE and not args.tensor_only:
            real_msprobe_dumps(work, rounds)
            for n in sizes:
                a = write_synthetic_msprobe(work / f"syn{n}_a", n, seed=1)
                b = write_synthetic_msprobe(work / f"syn{n}_b", n, seed=2)
                for _ in range(rounds if n == max(sizes) else 1):
                    synthetic_lines(n, a, b, work, measured=n == max(sizes))
            n = max(sizes)
            a = write_synthetic_msprobe(work / f"seq{n}_a", n, seed=1)
            b = write_synthetic_msprobe(work / f"seq{n}_b", n, seed=2, extra_every=100)
            mine, theirs = ours(a, b), msprobe(a / "step0", b / "step0", work / "out_fm", fuzzy=True)
            line(f"alignment, {n} calls, B +1% extra casts (-fm)", mine, theirs,
                 f"(in-process ours {ours_in_process(a, b):.2f} s, of which pairing {alignment_alone(a, b):.2f} s; "
                 f"ours: {mine.said[:90]}; msprobe: {theirs.said})")
            theirs = msprobe(a / "step0", b / "step0", work / "out_plain")
            line(f"alignment, {n} calls, B +1% extra casts (default)", mine, theirs, f"(msprobe: {theirs.said})")
        elif not MSPROBE:
            print("msprobe not installed (.venv/bin/pip install mindstudio-probe): msprobe cases skipped")
        tensor_throughput(work, 0.25 if args.quick else args.tensor_gb, rounds)
        if not args.tensor_only and not args.check:
            replay_cost(work, 1 if args.quick else 2, 1 if args.quick else 2)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.check:
        sys.exit(print_check([judge(name, values, GOALS[name]) for name, values in MEASURED.items() if values]))


def synthetic_lines(n: int, a: Path, b: Path, work: Path, measured: bool) -> None:
    """The synthetic pair of n calls: ours as a bare process and in process, and the command line,
    against msprobe's run; where `measured`, the ratios count towards the synthetic goals."""
    mine, theirs = ours(a, b), msprobe(a / "step0", b / "step0", work / f"out{n}")
    in_process = ours_in_process(a, b)
    line(f"statistics, synthetic {n} calls", mine, theirs,
         f"(in-process ours {in_process:.2f} s; ours: {mine.said[:90]}; msprobe: {theirs.said})")
    cli = ours_cli(a, b, None)
    line(f"statistics, synthetic {n} calls, CLI --no-html", cli, theirs, f"(ours: {cli.said})")
    if measured:
        MEASURED[SYNTHETIC_IN_PROCESS].append(theirs.seconds / in_process)
        MEASURED[SYNTHETIC_CLI].append(theirs.seconds / cli.seconds)


def real_msprobe_dumps(work: Path, rounds: int) -> None:
    from pi0align.testing.dumpfactory import write_msprobe_dump

    for task in ("statistics", "tensor"):
        a = write_msprobe_dump(work / f"real_{task}_a", task=task, width=256, depth=24)
        b = write_msprobe_dump(work / f"real_{task}_b", task=task, width=256, depth=24, scale=1 + 1e-3)
        (step_a,), (step_b,) = (list(p.glob("step0")) for p in (a, b))
        mine, theirs = ours(a, b), msprobe(step_a, step_b, work / f"out_real_{task}")
        line(f"{task}, msprobe dumps of a 24-layer MLP", mine, theirs,
             f"(in-process ours {ours_in_process(a, b):.2f} s; ours: {mine.said[:90]}; msprobe: {theirs.said})")
        cli_lines(f"{task}, 24-layer MLP", a, b, theirs, work)
        for _ in range(rounds - 1):
            theirs = msprobe(step_a, step_b, work / f"out_real_{task}")
            cli_lines(f"{task}, 24-layer MLP", a, b, theirs, work, html=False)


def cli_lines(case: str, a: Path, b: Path, theirs: Timed, work: Path, html: bool = True) -> None:
    """The command-line tool on a case, with (unless not `html`) and without its HTML report,
    against msprobe's run; on tensor dumps also without replay, which is what msprobe does (it
    replays nothing): replay imports torch, seconds that no speed-up of ours removes."""
    runs = ((("CLI + HTML", work / "report.html", True),) if html else ()) + (("CLI --no-html", None, True),)
    if case.startswith("tensor"):
        runs += (("CLI --no-html --no-replay", None, False),)
    for label, page, replay in runs:
        mine = ours_cli(a, b, page, replay)
        line(f"{case}, {label}", mine, theirs, f"(ours: {mine.said})")
        if page is None and "24-layer" in case and not (case.startswith("tensor") and replay):
            MEASURED[f"msprobe ÷ ours, its {case.split(',')[0]} dumps, CLI"].append(theirs.seconds / mine.seconds)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
