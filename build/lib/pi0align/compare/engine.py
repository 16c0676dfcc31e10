"""compare_dumps: locate two runs once and, a window of steps at a time (windows.py), open them at
its steps, pair and measure each rank's records (measuring/rank_pair.py), and hand them to the
Conclusion (conclusion.py), which judges them and finds the root cause. A step of more records than
a window holds is judged in groups of ranks, in two passes."""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from pi0align.compare.conclusion import RECORD_COLUMNS_JUDGED, Conclusion
from pi0align.compare.judging.reference import check_reference
from pi0align.compare.judging.thresholds import load_thresholds
from pi0align.compare.measuring.rank_pair import MeasuredRank, MeasuredWindow, measure_rank_pair, work_units
from pi0align.compare.reading.open_dump import Run, close_run, locate_run
from pi0align.compare.reading.records import Dump
from pi0align.compare.result import Comparison
from pi0align.compare.table import Table
from pi0align.compare.windows import plan_windows
from pi0align.errors import UserError

if TYPE_CHECKING:
    from concurrent.futures import ProcessPoolExecutor

Progress = Callable[[int, int], None]


def compare_dumps(path_a: str | Path, path_b: str | Path, *, thresholds: dict | None = None,
                  steps: Iterable[int] | None = None, progress: Progress | None = None,
                  noise: str | Path | None = None, replay: bool = True) -> Comparison:
    """Compare run B (under test, e.g. NPU) against run A (benchmark, e.g. GPU).

    path_a, path_b: a pi0align dump file, a run folder of per-rank dump files, or an msprobe dump
    folder. thresholds: as from load_thresholds() (defaults when None). steps: only these steps.
    progress: called as progress(done, total) while comparing. noise: a noise reference, A's run
    again with every result moved by an ulp (`pi0align run --perturb-ulps 1`): each record's
    limits follow how far it is from A. replay: replay each call in float64 where both dumps hold
    full tensors (docs/compare.md, "Noise models").
    """
    with _garbage_collector_paused():
        return _compare(path_a, path_b, thresholds or load_thresholds(), steps, progress, noise, replay)


@contextmanager
def _garbage_collector_paused() -> Iterator[None]:
    """A compare makes millions of small objects (msprobe's JSON alone: a dict per tensor), none in
    a reference cycle; the cyclic collector would walk all of them again and again while they are
    made, a third of the time. Reference counting still frees them."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _compare(path_a: str | Path, path_b: str | Path, thresholds: dict, steps: Iterable[int] | None,
             progress: Progress | None, noise: str | Path | None, replay: bool) -> Comparison:
    wanted = set(steps) if steps is not None else None
    runs = [locate_run(path).wanted(wanted) for path in [path_a, path_b] + ([noise] if noise is not None else [])]
    _check_runs(runs, wanted)
    steps_a, steps_b = runs[0].steps(), runs[1].steps()
    planned = plan_windows(runs[0], sorted(steps_a & steps_b))
    conclusion = Conclusion(thresholds, str(path_a), str(path_b), "reference" if noise is not None else "intrinsic",
                            sum(len(window.rank_groups) for window in planned))
    conclusion.note([f"step{'s' if len(only) > 1 else ''} {_listed(only)} held by {side} only: not compared"
                     for side, only in (("A", steps_a - steps_b), ("B", steps_b - steps_a)) if only])
    with _workers(len(runs[0].ranks) * (len(runs) - 1)) as pool:
        measuring = _Measuring(runs, replay, pool, _Tracker(progress, 0),
                               sum(len(w.rank_groups) * w.passes for w in planned))
        for index, window in enumerate(planned):
            alongside: dict[int, list] = {}  # each group's first culprits, judged alone (the first pass)
            if window.passes == 2:
                for group, ranks in enumerate(window.rank_groups):
                    with measuring.part(window.steps, ranks) as measured:
                        alongside[group] = conclusion.first_culprits(measured)
            for group, ranks in enumerate(window.rank_groups):
                with measuring.part(window.steps, ranks) as measured:
                    conclusion.add(measured, alongside=[position for other, found in alongside.items()
                                                        if other != group for position in found])
            if index + 1 < len(planned):
                gc.collect()  # whatever cycles the window left (the collector is paused meanwhile)
    return conclusion.comparison(measuring.runs_reference)


class _Measuring:
    """Opens the runs at some steps and ranks, measures each rank's pair, and closes them again."""

    def __init__(self, runs: list[Run], replay: bool, pool: ProcessPoolExecutor | None, tracker: _Tracker,
                 parts: int):
        self.runs, self.replay, self.pool, self.tracker = runs, replay, pool, tracker
        self.parts_left = parts  # to estimate the progress's total
        self.runs_reference: dict[int, Dump] | None = None
        self.checked = False

    @contextmanager
    def part(self, steps: tuple[int, ...], ranks: tuple[int, ...]) -> Iterator[MeasuredWindow]:
        """These steps and ranks measured, their dumps open meanwhile."""
        opened: list[dict[int, Dump]] = []
        try:
            for run in self.runs:
                opened.append(run.open(set(steps), set(ranks)))
            runs_a, runs_b = opened[0], opened[1]
            with_reference = len(opened) > 2
            if not self.checked:
                self._check(opened)
            pairs = [(runs_a[r], runs_b[r], self.replay, self.runs[1]) for r in sorted(runs_a)]
            if with_reference:
                pairs += [(runs_a[r], opened[2][r], False, self.runs[2]) for r in sorted(runs_a)]
            work = sum(work_units(a, b, replay) for a, b, replay, _ in pairs)
            self.tracker.total = self.tracker.done + work * self.parts_left  # the parts left taken alike
            self.parts_left -= 1
            measured = self._measure(pairs, set(steps))
            reference = Table.concat([m.rows for m in measured[len(runs_a):]]) if with_reference else None
            for runs in opened:
                _keep_judged_columns(runs)
            yield MeasuredWindow(tuple(measured[:len(runs_a)]), runs_a, runs_b, reference)
        finally:
            for runs in opened:
                close_run(runs)

    def _check(self, opened: list[dict[int, Dump]]) -> None:
        """Once, on the first window: the noise reference against A, and whether replay can run."""
        self.checked = True
        if len(opened) > 2:
            check_reference(opened[0], opened[2], str(self.runs[0].path), str(self.runs[2].path))
            self.runs_reference = opened[2]
        self.replay &= all(runs[r].mode == "tensor" for runs in opened[:2] for r in runs)
        if self.replay:
            _check_replay_imports()

    def _measure(self, pairs: list[tuple[Dump, Dump, bool, Run]], steps: set[int]) -> list[MeasuredRank]:
        """Each rank pair (A's dump, the other's, whether to replay, the other's run) measured, here
        or in the pool's processes (each opens its pair again from the located runs: open dumps do
        not cross processes)."""
        if self.pool is None:
            return [measure_rank_pair(a, b, replay, self.tracker.advance) for a, b, replay, _ in pairs]
        futures = [self.pool.submit(_measure_located, self.runs[0], run_b, a.rank, steps, replay)
                   for a, _, replay, run_b in pairs]
        measured = []
        for future, (a, b, replay, _) in zip(futures, pairs):
            measured.append(future.result())
            self.tracker.advance(work_units(a, b, replay))
        return measured


def _measure_located(run_a: Run, run_b: Run, rank: int, steps: set[int], replay: bool) -> MeasuredRank:
    """measure_rank_pair of one rank of two located runs (in a process of its own)."""
    opened = [run.open(steps, {rank}) for run in (run_a, run_b)]
    try:
        return measure_rank_pair(opened[0][rank], opened[1][rank], replay)
    finally:
        for runs in opened:
            close_run(runs)


def _check_runs(runs: list[Run], wanted: set[int] | None) -> None:
    """The same ranks on every side, some of the wanted steps held, and a step in common: two dumps
    with no step in common have nothing to compare, and are never "aligned"."""
    first = runs[0]
    for run in runs[1:]:
        if run.ranks != first.ranks:
            raise UserError(f"the runs have different ranks: {first.ranks} in {first.path}, {run.ranks} in {run.path}")
    for run in runs:
        if not run.steps() and wanted is not None:
            listed = ", ".join(map(str, sorted(wanted)[:10]))
            raise UserError(f"{run.path} holds none of the steps asked for ({listed})")
        if not run.steps():
            raise UserError(f"{run.path} holds no complete dumped step")
    if not runs[0].steps() & runs[1].steps():
        raise UserError(f"no step in common: {runs[0].path} holds steps {_listed(runs[0].steps())}, {runs[1].path} "
                        f"steps {_listed(runs[1].steps())} (runs are compared at the same steps: give both the same "
                        "--dump-steps)")


def _listed(steps: set[int]) -> str:
    ordered = sorted(steps)
    return ", ".join(map(str, ordered[:5])) + (f", ... ({len(ordered)} in all)" if len(ordered) > 5 else "")


def _keep_judged_columns(runs: dict[int, Dump]) -> None:
    """Once measured, a dump's records keep only what judging reads of them: after a window's
    rows, they are its largest tables."""
    for dump in runs.values():
        dump.records = dump.records.select(RECORD_COLUMNS_JUDGED)


class _Tracker:
    def __init__(self, progress: Progress | None, total: int):
        self.progress, self.total, self.done = progress, total, 0

    def advance(self, n: int = 1) -> None:
        self.done += n
        if self.progress:
            self.progress(self.done, self.total)


def _check_replay_imports() -> None:
    """Replay imports torch, which the rest of a comparison never needs: a torch that cannot be
    imported is said now, in one line, rather than as a traceback in the middle of the compare."""
    try:
        import pi0align.replay  # noqa: F401
    except (ImportError, OSError) as error:  # OSError: a shared library of torch's that will not load
        raise UserError(f"replaying the calls of full-tensor dumps needs torch, which does not import here "
                        f"({str(error).splitlines()[0] if str(error) else type(error).__name__}): "
                        "install it, or compare without replay (--no-replay)") from None


@contextmanager
def _workers(pairs: int) -> Iterator[ProcessPoolExecutor | None]:
    """Processes to measure `pairs` rank pairs in, one pair each, as many at once as there are
    cores, kept for every window; None where there is one pair or one core (measured here)."""
    workers = min(pairs, os.cpu_count() or 1)
    if workers < 2 or not _main_importable():
        yield None
        return
    import multiprocessing  # here: most compares (one rank pair) start no process
    from concurrent.futures import ProcessPoolExecutor

    context = multiprocessing.get_context("spawn")  # a fork would share the open HDF5 files
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        yield pool


def _main_importable() -> bool:
    """A spawned process imports the parent's main script again: none (a notebook) or a file, not
    a script read from standard input."""
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    return main is None or Path(main).is_file()
