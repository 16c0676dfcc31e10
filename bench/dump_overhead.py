"""Step time of PI0 training with the dumper, as ratios to the same steps without it.

Small preset, CPU (or --device), one CPU thread. Plain and dumped steps alternate in one process,
each dumped step timed against the plain step just before it, `--pairs` times a round, the round's
ratio their median (single ratios range over ±0.15: a dumped step sometimes takes 10 % longer than
its neighbours; a CPU step drifts over a long run; fixed `MALLOC_*` thresholds, set by re-executing
this script, steady glibc's allocator). Variants:
our Dumper idle (started, step not selected), stats, sample and tensor mode at level mix, and stats
at level api (msprobe's L1 records API calls only), all without the optimizer's update, as msprobe;
and stats with it, as `pi0align run --dump-steps` records it (`start(policy, optimizer=...)`). Every
mode hands the step to the dumper's writer process and goes on (the writer finishes, and the OS
writes the dirty pages, untimed, before the next timed step); the "until ..." variants also wait
(`Dumper.flush()`) until the step is written: the whole cost, paid by the training thread only when
the writer falls behind (in tensor mode, when steps are dumped back to back). msprobe's
PrecisionDebugger (when installed) at L1 and mix, statistics and tensor, each in its own process
because it is a process-wide singleton. Also bytes written per dumped step, and the device ops each
dump backend issues per recorded tensor (counted by a TorchDispatchMode: the ops of a dumped step
beyond those of the same step undumped; views are not counted, they launch nothing). The torch
backend is what an accelerator runs.

    .venv/bin/python bench/dump_overhead.py [--device cpu] [--preset small] [--rounds 5] [--pairs 3]
        [--batch-size 8] [--check]

Each ratio is the median of the rounds' ratios, printed with its run-to-run noise (half their
range). `--check` also judges the goals (stats, sample and tensor at level mix ≤ 1.10×, 1.15×,
1.30×; idle ≤ 1.02×; device ops per recorded tensor on the torch backend ≤ 2) and exits 1 when one
is missed by more than its noise (bench/goals.py).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from goals import Goal, judge, print_check

MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 31),
              "MALLOC_TOP_PAD_": str(1 << 28), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
# variant -> (mode, level, backend); idle: started, but the step is not one to dump
OURS = {"idle": None, "stats": ("stats", "mix", "auto"), "stats, until written": ("stats", "mix", "auto"),
        "stats, torch backend": ("stats", "mix", "torch"), "stats (api level)": ("stats", "api", "auto"),
        "stats, optimizer recorded": ("stats", "mix", "auto"),
        "sample": ("sample", "mix", "auto"), "sample, until written": ("sample", "mix", "auto"),
        "tensor": ("tensor", "mix", "auto"), "tensor, uncompressed": ("tensor", "mix", "auto"),
        "tensor, until on disk": ("tensor", "mix", "auto")}
GOALS = {"stats": Goal(1.10), "sample": Goal(1.15), "tensor": Goal(1.30), "idle": Goal(1.02)}
OPS_GOAL = Goal(2.0, unit="")  # device ops per recorded tensor, torch backend, every level
MSPROBE = {"msprobe L1 statistics": ("statistics", "L1"), "msprobe mix statistics": ("statistics", "mix"),
           "msprobe L1 tensor": ("tensor", "L1")}


def _folder(work: Path, variant: str) -> Path:
    """Where a variant's dumps go."""
    return work / variant.replace(" ", "_").replace(",", "")


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def build(args, work: Path):
    """(policy, optimizer, step): a training step of one fixed preprocessed batch, as `pi0align run`
    trains it on `args.device`, returning when the device is done with it (`step(after_backward)`:
    with a call between the backward and the optimizer's step)."""
    import torch

    from pi0align.device import resolve
    from pi0align.train.config import TrainConfig
    from pi0align.train.data import make_loader
    from pi0align.train.loop import build_components, train_step

    torch.set_num_threads(1)
    config = TrainConfig(device=args.device, preset=args.preset, batch_size=args.batch_size, threads=1, steps=10_000,
                         out=work, progress=False)
    device = resolve(args.device)
    parts = build_components(config, device)
    loader = make_loader(parts["dataset"], batch_size=args.batch_size, seed=config.seed, start_step=0, steps=1,
                         num_workers=0, pin_memory=False)
    batch = parts["preprocessor"](next(iter(loader)))
    policy, optimizer, scheduler = parts["policy"], parts["optimizer"], parts["scheduler"]

    def step(after_backward=None):
        train_step(policy, batch, optimizer, scheduler, policy.config.optimizer_grad_clip_norm, after_backward)
        device.synchronize()

    return policy, optimizer, step


def alternate(step_plain, variants: dict, rounds: int, pairs: int,
              settle: dict | None = None, prepare: dict | None = None) -> dict[str, list[float]]:
    """{variant: [per round, the median over `pairs` of time(variant step) / time(plain step just
    before)]} over `rounds` rounds. `settle[name]`, untimed, runs after each of the variant's steps:
    work it left behind (a writer process finishing its tensors, the OS writing them to disk) must
    not slow down the steps timed next. `prepare[name]`, untimed, runs before each: what a run does
    once, not at every step (hooks put on), which the plain step must not have."""
    ratios = {name: [] for name in variants}
    settle, prepare = settle or {}, prepare or {}
    step_plain()  # warm-up
    for name, run in variants.items():
        prepare.get(name, lambda: None)()
        run()
        settle.get(name, lambda: None)()
    for _ in range(rounds):
        for name, run in variants.items():
            paired = []
            for _ in range(pairs):
                started = time.perf_counter()
                step_plain()
                plain = time.perf_counter() - started
                prepare.get(name, lambda: None)()
                started = time.perf_counter()
                run()
                paired.append((time.perf_counter() - started) / plain)
                settle.get(name, lambda: None)()
            ratios[name].append(statistics.median(paired))
    return ratios


def bench_ours(args, work: Path) -> list[tuple[str, list[float], float, int]]:
    from pi0align import Dumper
    from pi0align.train.loop import frozen_heap

    policy, optimizer, step = build(args, work / "run")
    dumpers, variants, counts = {}, {}, {}
    for name, how in OURS.items():
        mode, level, backend = how or ("stats", "mix", "auto")
        dumper = Dumper(_folder(work, name), steps=[] if how is None else None,
                        level=level, mode=mode, compress="uncompressed" not in name, backend=backend)
        dumper.start(policy)
        dumper.stop()
        dumpers[name], counts[name] = dumper, 0

        def run(dumper=dumper, name=name):
            dumper.start(policy, optimizer=optimizer if "optimizer" in name else None)
            step()
            dumper.step()
            dumper.stop()
            if "until" in name:  # the step written, not only handed to the writer process
                dumper.flush()
            counts[name] += 1

        variants[name] = run
    def settle(dumper):
        dumper.flush()
        os.sync()  # the OS writes the dirty pages now, not during the steps timed next

    settles = {name: functools.partial(settle, dumper) for name, dumper in dumpers.items()}
    with frozen_heap():  # as `pi0align run` steps
        ratios = alternate(step, variants, args.rounds, args.pairs, settle=settles)
    for dumper in dumpers.values():
        dumper.__exit__(None, None, None)
    plain_time = _plain_time(step)
    return [(name, r, plain_time, folder_bytes(_folder(work, name)) // counts[name] if OURS[name] else 0)
            for name, r in ratios.items()]


def device_ops_per_record(args, work: Path) -> dict[str, tuple[float, int]]:
    """{backend and level: (device ops per recorded tensor, records)} of one dumped step in stats
    mode. At level module the capture does not see in-place calls, so a queued tensor could change
    before its batch is reduced: there the torch backend queues a copy of each (one more op)."""
    import h5py
    from torch.utils._python_dispatch import TorchDispatchMode

    from pi0align import Dumper

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += not func.is_view
            return func(*args, **(kwargs or {}))

    policy, optimizer, plain_step = build(args, work / "ops")

    def counted(run) -> int:
        Count.ops = 0
        with Count():
            run()
        return Count.ops

    plain_step()  # the optimizer makes its states at its first step
    plain = counted(plain_step)
    out = {}
    for backend, level in (("native", "mix"), ("torch", "mix"), ("torch", "module")):
        dumper = Dumper(work / f"ops-{backend}-{level}", level=level, mode="stats", backend=backend)
        dumper.start(policy, optimizer=optimizer)

        def dumped(dumper=dumper):
            plain_step()
            dumper.step()

        dumped()  # its first step makes what later ones reuse
        ops = counted(dumped)
        dumper.close()
        with h5py.File(dumper.file, "r") as f:
            records = len(f["steps/000001/records/role"])
        out[f"{backend} backend, level {level}"] = ((ops - plain) / records, records)
    return out


def bench_msprobe(args, work: Path, name: str) -> list[tuple[str, list[float], float, int]]:
    from msprobe.pytorch import PrecisionDebugger

    from pi0align.train.loop import frozen_heap

    task, level = MSPROBE[name]
    policy, _, step = build(args, work / "run")

    out = work / "msprobe"
    debugger = PrecisionDebugger(task=task, dump_path=str(out), level=level)
    count = 0

    def run():
        nonlocal count
        debugger.start(policy)
        step()
        debugger.stop()
        debugger.step()
        count += 1

    with frozen_heap():
        ratios = alternate(step, {name: run}, args.rounds, args.pairs)
    return [(name, ratios[name], _plain_time(step), folder_bytes(out) // count)]


def profile_dumped_step(args, work: Path, steps: int = 5) -> None:
    """Where a dumped step's extra time goes (stats, level mix): cProfile over `steps` plain steps
    and as many dumped ones, the difference in own time grouped by the part of the code it is spent
    in (dump's modules by file; torch and the model as one group each; C++ called from Python
    counted in its Python caller; torch's by file and function: hooks make modules take torch's slow
    call path, which is where much of the module level's cost lands)."""
    import cProfile
    import pstats

    from pi0align import Dumper

    policy, optimizer, step = build(args, work / "profile")
    dumper = Dumper(work / "profiled", level="mix", mode="stats")

    def dumped():
        dumper.start(policy, optimizer=optimizer)
        step()
        dumper.step()
        dumper.stop()

    dumped()  # its first step makes what later ones reuse
    print_phases(policy, optimizer, step, dumper, steps)
    print_per_call(work)
    own: dict[str, list[float]] = {}
    for label, run in (("plain", step), ("dumped", dumped)):
        profiler = cProfile.Profile()
        profiler.runcall(lambda run=run: [run() for _ in range(steps)])
        for (file, _, function), (_, _, tottime, _, _) in pstats.Stats(profiler).stats.items():
            own.setdefault(_part(file, function), [0.0, 0.0])[label == "dumped"] += tottime / steps
    dumper.close()
    plain_total, dumped_total = (sum(times[i] for times in own.values()) for i in (0, 1))
    print(f"a dumped step (stats, level mix) against a plain one, cProfile, {steps} steps each: "
          f"{dumped_total:.3f} s against {plain_total:.3f} s (profiled, so both slower than unprofiled)")
    print(f"{'part':48s} {'extra s/step':>12s} {'share':>6s}")
    extra = sorted(((times[1] - times[0], part) for part, times in own.items()), reverse=True)
    for seconds, part in extra[:20]:
        print(f"{part:48s} {seconds:12.4f} {seconds / (dumped_total - plain_total):6.0%}")


def print_per_call(work: Path, calls: int = 2000, rounds: int = 15) -> None:
    """The capture's cost per call, where a step's ratio hides a few milliseconds in its noise: a
    chain of `calls` multiplications of 16 elements, forward and backward, the fastest of `rounds`,
    plain, under a bare TorchFunctionMode (what torch's dispatch to any mode costs) and dumped
    (stats, level mix)."""
    import torch
    from torch.overrides import TorchFunctionMode

    from pi0align import Dumper

    class Chain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(16))

        def forward(self, x):
            for _ in range(calls):
                x = x * self.weight
            return x.sum()

    class BareMode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    chain, x, mode = Chain(), torch.randn(16), BareMode()
    dumper = Dumper(work / "per-call", level="mix", mode="stats")

    def dumped_stop():
        dumper.step()
        dumper.stop()
        dumper.flush()

    ways = {"plain": (lambda: None, lambda: None), "a bare TorchFunctionMode": (mode.__enter__, lambda: mode.__exit__(
        None, None, None)), "dumped (stats, level mix)": (lambda: dumper.start(chain), dumped_stop)}
    print(f"per call, a chain of {calls} multiplications (fastest of {rounds})")
    print(f"{'':28s} {'forward µs':>11s} {'backward µs':>12s}")
    for way, (begin, end) in ways.items():
        forward, backward = [], []
        for _ in range(rounds):
            begin()
            started = time.perf_counter()
            loss = chain(x)
            middle = time.perf_counter()
            loss.backward()
            forward.append(middle - started)
            backward.append(time.perf_counter() - middle)
            end()
        print(f"{way:28s} {1e6 * min(forward) / calls:11.2f} {1e6 * min(backward) / calls:12.2f}")
    dumper.close()


def print_phases(policy, optimizer, step, dumper, steps: int) -> None:
    """Unprofiled, the median seconds of each phase of a plain and a dumped step (stats, level mix,
    the optimizer's update recorded): the policy's forward and the optimizer's step, timed by their
    own hooks, the dumper's step end (`Dumper.step()`: its statistics awaited, its tables handed to
    the writer), and the rest of the training step (backward, clipping, the schedule)."""
    clock = time.perf_counter
    marks: dict[str, float] = {}

    def mark(name: str):
        return lambda *_: marks.__setitem__(name, clock())

    hooks = [policy.register_forward_pre_hook(mark("forward")), policy.register_forward_hook(mark("forward end")),
             optimizer.register_step_pre_hook(mark("update")), optimizer.register_step_post_hook(mark("update end"))]
    phases: dict[str, list[list[float]]] = {}
    for _ in range(steps):
        for dumping in (False, True):  # alternating: a CPU step drifts
            if dumping:
                dumper.start(policy, optimizer=optimizer)
            started = clock()
            step()
            ended = clock()
            if dumping:
                dumper.step()
                dumper.stop()
            seen = {"forward": marks["forward end"] - marks["forward"],
                    "optimizer's step": marks["update end"] - marks["update"],
                    "the dumper's step end": clock() - ended if dumping else 0.0}
            seen["backward and the rest"] = ended - started - seen["forward"] - seen["optimizer's step"]
            for phase, seconds in seen.items():
                phases.setdefault(phase, [[], []])[dumping].append(seconds)
            if dumping:
                dumper.flush()
    for hook in hooks:
        hook.remove()
    print(f"a step by phase, unprofiled (median of {steps}; stats, level mix, the optimizer recorded)")
    print(f"{'phase':28s} {'plain ms':>9s} {'dumped ms':>10s} {'extra ms':>9s}")
    for phase, (plain, dumped) in phases.items():
        plain_ms, dumped_ms = 1000 * statistics.median(plain), 1000 * statistics.median(dumped)
        print(f"{phase:28s} {plain_ms:9.1f} {dumped_ms:10.1f} {dumped_ms - plain_ms:9.1f}")


def _part(file: str, function: str) -> str:
    """A profiled function's part: a dump module by file name, else a coarse group."""
    if "pi0align/dump/" in file:
        return f"pi0align.dump.{Path(file).stem}.{function}"
    if "/torch/" in file:
        return f"torch: {file.rpartition('/torch/')[2].removesuffix('.py')}.{function}"[:48]
    if file == "~" and "torch" in function:
        return f"torch C++: {function.removeprefix('<built-in method ')}"[:48]
    if "lerobot" in file or "transformers" in file:
        return "the model's own Python"
    return "other" if file != "~" else f"built-in: {function}"[:48]


def _plain_time(step) -> float:
    times = []
    for _ in range(3):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def msprobe_available() -> str | None:
    """None when msprobe imports, else why not (one line)."""
    try:
        from msprobe.pytorch import PrecisionDebugger  # noqa: F401
    except Exception as error:  # noqa: BLE001 - any import failure is reported, not raised
        return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu, cuda or npu")
    parser.add_argument("--preset", default="small", choices=("tiny", "small"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--pairs", type=int, default=3, help="plain and dumped steps timed per variant and round")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--skip-msprobe", action="store_true")
    parser.add_argument("--check", action="store_true", help="judge the goals; exit 1 when one is missed")
    parser.add_argument("--profile", action="store_true",
                        help="only profile a dumped step (stats, level mix) against a plain one, by phase, "
                             "by part, and per call")
    parser.add_argument("--msprobe-variant", help=argparse.SUPPRESS)  # internal: one msprobe variant, JSON out
    args = parser.parse_args()
    if any(os.environ.get(k) != v for k, v in MALLOC_ENV.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **MALLOC_ENV})

    work = Path(tempfile.mkdtemp(prefix="pi0align-bench-"))
    try:
        if args.msprobe_variant:
            print(json.dumps(bench_msprobe(args, work, args.msprobe_variant)))
            return 0
        if args.profile:
            profile_dumped_step(args, work)
            return 0
        rows = bench_ours(args, work)
        ops = device_ops_per_record(args, work)
        why_not = "skipped (--skip-msprobe)" if args.skip_msprobe else msprobe_available()
        if why_not is None:
            for name in MSPROBE:
                result = subprocess.run([sys.executable, __file__, "--device", args.device, "--preset", args.preset,
                                         "--rounds", str(args.rounds), "--pairs", str(args.pairs),
                                         "--batch-size", str(args.batch_size),
                                         "--msprobe-variant", name],
                                        capture_output=True, text=True)
                if result.returncode == 0:
                    rows += [tuple(r) for r in json.loads(result.stdout.strip().splitlines()[-1])]
                else:
                    print(f"{name}: failed: {result.stderr.strip().splitlines()[-1]}")
        else:
            print(f"msprobe: not measured: {why_not}")
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"preset {args.preset}, batch {args.batch_size}, {args.device}, 1 CPU thread, {args.rounds} rounds of "
          f"{args.pairs} pairs (median of the rounds' median dumped/plain step-time ratios)")
    print(f"{'variant':28s} {'ratio':>7s} {'± noise':>8s} {'plain step s':>13s} {'bytes/step':>12s}")
    judged = {name: judge(name, ratios, GOALS.get(name, Goal(float("inf")))) for name, ratios, _, _ in rows}
    for name, _, plain, size in rows:
        print(f"{name:28s} {judged[name].median:7.2f} {judged[name].noise:8.2f} {plain:13.3f} {size:12,d}")
    for variant, (per_record, records) in ops.items():
        print(f"device ops per recorded tensor, {variant}: {per_record:.2f} ({records} records a step)")
    if "msprobe L1 statistics" in judged:
        print(f"msprobe L1 statistics overhead / ours (stats): "
              f"{(judged['msprobe L1 statistics'].median - 1) / max(judged['stats'].median - 1, 1e-9):.1f}x")
    if not args.check:
        return 0
    return print_check([judged[name] for name in GOALS] + [
        judge(f"device ops per recorded tensor, {variant}", [per_record], OPS_GOAL)
        for variant, (per_record, _) in ops.items() if variant.startswith("torch")])


if __name__ == "__main__":
    sys.exit(main())
