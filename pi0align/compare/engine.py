"""compare_dumps: open two runs and, a window of steps at a time, pair their records, measure
them, and hand them to the Conclusion (conclusion.py), which judges them and finds the root cause.
A step of more records than a window holds is judged in groups of ranks, in two passes."""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pi0align.compare.conclusion import RECORD_COLUMNS_JUDGED, Conclusion
from pi0align.compare.judging.reference import check_reference
from pi0align.compare.judging.thresholds import load_thresholds
from pi0align.compare.judging.verdict import JUDGED_PAIRINGS
from pi0align.compare.measuring.align import pair_records
from pi0align.compare.measuring.arguments import adam_step, arguments_differ, hyper_parameter_differences
from pi0align.compare.measuring.kernels import FIELDS
from pi0align.compare.measuring.memory import HeapTrimmer
from pi0align.compare.measuring.metrics import (
    STATS_METRICS,
    TENSOR_METRICS,
    metrics_of_sums,
    sample_metrics,
    stats_metrics,
    tensor_sums,
)
from pi0align.compare.reading.open_dump import dumped_steps, open_run
from pi0align.compare.reading.records import Dump
from pi0align.compare.result import Comparison
from pi0align.compare.table import Table, gather, isin
from pi0align.errors import UserError

if TYPE_CHECKING:
    from concurrent.futures import ProcessPoolExecutor

Progress = Callable[[int, int], None]
# Records judged at once (a window of steps, conclusion.py): a window's rows and their stages take
# about 1.5 KB a record at their peak, so about 150 MB; the dumps' other steps wait on disk.
ROWS_PER_WINDOW = 100_000


@dataclass(frozen=True)
class Window:
    """Steps judged together, and the groups of ranks judged together: every rank in one group,
    except for a step of more than ROWS_PER_WINDOW records, whose ranks are judged a group at a
    time, twice: first to find each group's first culprits, then again knowing the other groups'
    (a call that parts one rank reaches the others through the all-reduce, judge.downstream)."""

    steps: list[int]
    rank_groups: list[list[int]]

    @property
    def passes(self) -> int:
        return 1 if len(self.rank_groups) == 1 else 2


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
    paths = [path_a, path_b] + ([noise] if noise is not None else [])
    held = [_steps_held(path, wanted) for path in paths]
    _check_runs(held, paths, wanted)
    steps_a, steps_b = (set().union(*ranks.values()) for ranks in held[:2])
    windows = _windows(path_a, held[0], sorted(steps_a & steps_b))
    conclusion = Conclusion(thresholds, str(path_a), str(path_b), "reference" if noise is not None else "intrinsic",
                            sum(len(window.rank_groups) for window in windows))
    conclusion.note([f"step{'s' if len(only) > 1 else ''} {_listed(only)} held by {side} only: not compared"
                     for side, only in (("A", steps_a - steps_b), ("B", steps_b - steps_a)) if only])
    with _workers(len(held[0]) * (len(paths) - 1)) as pool:
        measuring = _Measuring(paths, replay, pool, _Tracker(progress, 0),
                               sum(len(w.rank_groups) * w.passes for w in windows))
        for index, window in enumerate(windows):
            alongside: dict[int, list] = {}  # each group's first culprits, judged alone (the first pass)
            if window.passes == 2:
                for group, ranks in enumerate(window.rank_groups):
                    with measuring.part(window.steps, ranks) as measured:
                        alongside[group] = conclusion.first_culprits(*measured)
            for group, ranks in enumerate(window.rank_groups):
                with measuring.part(window.steps, ranks) as measured:
                    conclusion.add(*measured, alongside=[position for other, found in alongside.items()
                                                         if other != group for position in found])
            if index + 1 < len(windows):
                gc.collect()  # whatever cycles the window left (the collector is paused meanwhile)
    return conclusion.comparison(measuring.runs_reference)


class _Measuring:
    """Opens the runs at some steps and ranks, measures each rank's pair, and closes them again."""

    def __init__(self, paths: list, replay: bool, pool: ProcessPoolExecutor | None, tracker: _Tracker, parts: int):
        self.paths, self.replay, self.pool, self.tracker = paths, replay, pool, tracker
        self.parts_left = parts  # to estimate the progress's total
        self.runs_reference: dict[int, Dump] | None = None
        self.checked = False

    @contextmanager
    def part(self, steps: list[int], ranks: list[int]) -> Iterator[tuple[list, dict, dict, Table | None]]:
        """(each rank's measured rows, notes and differing optimizer settings; A's and B's Dumps;
        the noise reference's rows or None) at these steps and ranks, their dumps open meanwhile."""
        opened: list[dict[int, Dump]] = []
        try:
            for path in self.paths:
                opened.append(open_run(path, set(steps), set(ranks)))
            runs_a, runs_b = opened[0], opened[1]
            with_reference = len(opened) > 2
            if not self.checked:
                self.checked = True
                if with_reference:
                    check_reference(runs_a, opened[2], self.paths[0], self.paths[2])
                    self.runs_reference = opened[2]
                self.replay &= all(runs[r].mode == "tensor" for runs in (runs_a, runs_b) for r in runs)
                if self.replay:
                    _check_replay_imports()
            pairs = [(runs_a[r], runs_b[r], self.replay) for r in sorted(runs_a)]
            if with_reference:
                pairs += [(runs_a[r], opened[2][r], False) for r in sorted(runs_a)]
            work = sum(_work(a, b, replay) for a, b, replay in pairs)
            self.tracker.total = self.tracker.done + work * self.parts_left  # the parts left taken alike
            self.parts_left -= 1
            parts = _compare_pairs(pairs, set(steps), self.tracker, self.pool)
            reference = Table.concat([p[0] for p in parts[len(runs_a):]]) if with_reference else None
            for runs in opened:
                _keep_judged_columns(runs)
            yield parts[:len(runs_a)], runs_a, runs_b, reference
        finally:
            for runs in opened:
                _close(runs)


def _steps_held(path: str | Path, wanted: set[int] | None) -> dict[int, dict[int, int | None]]:
    """{rank: {step: its number of records, or None}} of the steps held at `path`, of those wanted."""
    return {rank: {step: count for step, count in steps.items() if wanted is None or step in wanted}
            for rank, steps in dumped_steps(path).items()}


def _check_runs(held: list[dict[int, dict]], paths: list, wanted: set[int] | None) -> None:
    """The same ranks on every side, some of the wanted steps held, and a step in common: two dumps
    with no step in common have nothing to compare, and are never "aligned"."""
    for path, ranks in zip(paths[1:], held[1:]):
        if set(ranks) != set(held[0]):
            raise UserError(f"the runs have different ranks: {sorted(held[0])} in {paths[0]}, "
                            f"{sorted(ranks)} in {path}")
    steps = [set().union(*ranks.values()) for ranks in held]
    for path, found in zip(paths, steps):
        if not found and wanted is not None:
            listed = ", ".join(map(str, sorted(wanted)[:10]))
            raise UserError(f"{path} holds none of the steps asked for ({listed})")
        if not found:
            raise UserError(f"{path} holds no complete dumped step")
    if not steps[0] & steps[1]:
        raise UserError(f"no step in common: {paths[0]} holds steps {_listed(steps[0])}, {paths[1]} steps "
                        f"{_listed(steps[1])} (runs are compared at the same steps: give both the same --dump-steps)")


def _windows(path_a: str | Path, held_a: dict[int, dict[int, int | None]], steps: list[int]) -> list[Window]:
    """The steps in windows of at most ROWS_PER_WINDOW of A's records, every rank's, by each step's
    count where the dump tells it, else as many as its first step holds (read to count, a rank at
    a time). A step of more records has a window of its own, its ranks in groups of at most that
    many (one rank at least each)."""
    counts = {step: {rank: held_a[rank].get(step) or 0 for rank in held_a} for step in steps}
    if any(None in ranks.values() for ranks in held_a.values()) and (len(steps) > 1 or len(held_a) > 1):
        first = min(step for ranks in held_a.values() for step in ranks)
        counts = dict.fromkeys(steps, {rank: _records(path_a, first, rank) for rank in held_a})
    windows: list[Window] = []
    whole: dict[int, int] = {}  # steps judged with every rank since the last one split, their records

    def add_whole() -> None:
        windows.extend(Window(packed, [sorted(held_a)]) for packed in _packed(whole))
        whole.clear()

    for step in steps:
        if sum(counts[step].values()) > ROWS_PER_WINDOW and len(counts[step]) > 1:
            add_whole()
            windows.append(Window([step], _packed(counts[step])))
        else:
            whole[step] = sum(counts[step].values())
    add_whole()
    return windows


def _records(path: str | Path, step: int, rank: int) -> int:
    """The number of records of one rank at one step, read to count them."""
    opened = open_run(path, {step}, {rank})
    try:
        return sum(len(dump.records) for dump in opened.values())
    finally:
        _close(opened)


def _packed(counts: dict[int, int]) -> list[list[int]]:
    """The keys (steps, or ranks) in order, in groups of at most ROWS_PER_WINDOW records (`counts`:
    each key's), one key at least each."""
    groups: list[list[int]] = []
    held = 0  # records in the last group
    for key in sorted(counts):
        if not groups or held + counts[key] > ROWS_PER_WINDOW:
            groups.append([])
            held = 0
        groups[-1].append(key)
        held += counts[key]
    return groups


def _listed(steps: set[int]) -> str:
    ordered = sorted(steps)
    return ", ".join(map(str, ordered[:5])) + (f", ... ({len(ordered)} in all)" if len(ordered) > 5 else "")


def _keep_judged_columns(runs: dict[int, Dump]) -> None:
    """Once measured, a dump's records keep only what judging reads of them: after a window's
    rows, they are its largest tables."""
    for dump in runs.values():
        dump.records = dump.records.select(RECORD_COLUMNS_JUDGED)


def _close(runs: dict[int, Dump]) -> None:
    for dump in runs.values():
        dump.close()


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


def _work(a: Dump, b: Dump, replay: bool) -> int:
    """Units of progress: one per step, plus one per tensor pair to stream and per call to replay."""
    steps = len(set(a.records["step"].tolist()) | set(b.records["step"].tolist()))
    tensors = int((a.records["tensor"] != "").sum()) if a.mode == b.mode == "tensor" else 0
    calls = len(set(zip(a.records["step"].tolist(), a.records["call"].tolist()))) if replay else 0
    return steps + tensors + calls


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


def _compare_pairs(pairs: list[tuple[Dump, Dump, bool]], wanted: set[int] | None, tracker: _Tracker,
                   pool: ProcessPoolExecutor | None) -> list[tuple[Table, list[str], list]]:
    """Each rank pair measured (_compare_rank), here or in `pool`'s processes (each opens its pair
    again by path: open dumps do not cross processes)."""
    if pool is None:
        return [_compare_rank(a, b, tracker, replay) for a, b, replay in pairs]
    futures = [pool.submit(_compare_rank_at, a.source, b.source, a.rank, wanted, replay) for a, b, replay in pairs]
    parts = []
    for future, (a, b, replay) in zip(futures, pairs):
        parts.append(future.result())
        tracker.advance(_work(a, b, replay))
    return parts


def _main_importable() -> bool:
    """A spawned process imports the parent's main script again: none (a notebook) or a file, not
    a script read from standard input."""
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    return main is None or Path(main).is_file()


def _compare_rank_at(source_a: str, source_b: str, rank: int, wanted: set[int] | None,
                     replay: bool) -> tuple[Table, list[str], list]:
    """_compare_rank of one rank of two dumps given by path (in a process of its own)."""
    opened = [open_run(source, wanted, {rank}) for source in (source_a, source_b)]
    try:
        return _compare_rank(opened[0][rank], opened[1][rank], _Tracker(None, 0), replay)
    finally:
        for runs in opened:
            _close(runs)


def _compare_rank(a: Dump, b: Dump, tracker: _Tracker, replay: bool) -> tuple[Table, list[str], list]:
    """Rows of one rank (metrics filled, not yet judged), notes, and the optimizer settings that
    differ."""
    ra, rb = a.records, b.records
    pairs = pair_records(ra, rb)
    ia, ib = pairs["ia"], pairs["ib"]
    side_a, side_b = _Side(ra, ia), _Side(rb, ib)
    either = np.where(ia >= 0, ia, len(ra) + ib)  # a's record where there is one, else b's
    pick = lambda column: np.concatenate([ra[column], rb[column]])[either]
    rows = Table({
        "step": pick("step").astype(np.int64),
        "seq_a": side_a.values("seq", np.nan), "seq_b": side_b.values("seq", np.nan),
        "name": pick("name"), "module": pick("module"), "api": pick("api"), "direction": pick("direction"),
        "role": pick("role"), "arg_index": pick("arg_index").astype(np.int64),
        "dtype_a": side_a.values("dtype", ""), "dtype_b": side_b.values("dtype", ""),
        "shape_a": side_a.values("shape", ""), "shape_b": side_b.values("shape", ""),
        "pairing": pairs["pairing"],
        "evidence": np.full(len(ia), "", object), "stack": pick("stack"), "rank": np.full(len(ia), a.rank, np.int64),
        # internal, not in ROW_COLUMNS: statistics for the bounds, the rounding-noise rule and which
        # records hold the same tensor (bounds.py, noise.py, identity.py)
        **{f"{s}_{side}": values.values(s, np.nan) for s in ("min", "max", "mean", "norm")
           for side, values in (("a", side_a), ("b", side_b))},
        "checksum_a": side_a.values("checksum", -1), "checksum_b": side_b.values("checksum", -1),
        "requires_grad_a": side_a.values("requires_grad", -1), "requires_grad_b": side_b.values("requires_grad", -1),
    }, length=len(ia), nullable_ints=("seq_a", "seq_b"))
    for metric in TENSOR_METRICS + STATS_METRICS:
        rows[metric] = np.full(len(ia), np.nan)
    comparable = isin(rows["pairing"], JUDGED_PAIRINGS)
    _fill_stats(rows, side_a, side_b, comparable)
    notes = []
    if a.mode == b.mode == "sample" and a.sample_reader and b.sample_reader:
        notes += _fill_samples(rows, side_a, side_b, comparable, a, b)
    done = 0  # units of progress made below

    def advance() -> None:
        nonlocal done
        done += 1
        tracker.advance()

    if replay:  # one pass over the calls: each tensor read once, for its metrics and the replay
        from pi0align.compare.measuring.replayed import measure_and_replay

        for column, values in measure_and_replay(rows, a, b, ia, ib, comparable, advance).items():
            rows[column] = values
        rows["evidence"][~np.isnan(rows["rel_l2_err"])] = "tensor"
    else:
        if a.mode == b.mode == "tensor":
            _fill_tensors(rows, side_a, side_b, comparable, a, b, advance)
        rows["local_error_a"], rows["local_error_b"] = np.full(len(ia), np.nan), np.full(len(ia), np.nan)
        rows["replay"] = np.full(len(ia), "", dtype=object)
    rows["args_differ"] = arguments_differ(rows, a, b, ia, ib)
    rows["update_step"], rows["learning_rate_sum"] = _update_steps(rows, a, ia)
    tracker.advance(max(_work(a, b, replay) - done, 0))  # steps, unpaired tensors, calls not replayed
    return rows, notes, _hyper_parameters(a, b)


class _Side:
    """One side's record of each row, column by column; `missing` where the side has none."""

    def __init__(self, records: Table, rows: np.ndarray):
        self.records, self.rows = records, rows

    def values(self, column: str, missing: str | float) -> np.ndarray:
        """The column as text when `missing` is a str, float64 when a float, int64 when an int."""
        dtype = object if isinstance(missing, str) else np.float64 if isinstance(missing, float) else np.int64
        return gather(self.records[column], self.rows, missing).astype(dtype)


def _fill_stats(rows: Table, sa: _Side, sb: _Side, mask: np.ndarray) -> None:
    keys = ("min", "max", "mean", "norm", "numel")
    errors = stats_metrics({k: sa.values(k, np.nan) for k in keys}, {k: sb.values(k, np.nan) for k in keys})
    for metric, values in errors.items():
        rows[metric][mask] = values[mask]
    with np.errstate(invalid="ignore"):
        mismatch = (np.abs(sa.values("nan_count", np.nan) - sb.values("nan_count", np.nan))
                    + np.abs(sa.values("inf_count", np.nan) - sb.values("inf_count", np.nan)))
    rows["nan_inf_mismatch"][mask] = mismatch[mask]
    rows["evidence"][mask] = "stats"


def _fill_samples(rows: Table, sa: _Side, sb: _Side, mask: np.ndarray, a: Dump, b: Dump) -> list[str]:
    notes = []
    sample_a, sample_b = sa.values("sample_row", -1), sb.values("sample_row", -1)
    use = mask & (sample_a >= 0) & (sample_b >= 0)
    steps = rows["step"]
    for step in np.unique(steps[use]):
        sel = np.flatnonzero(use & (steps == step))
        values_a, positions_a = a.sample_reader(int(step))
        values_b, positions_b = b.sample_reader(int(step))
        row_a, row_b = sample_a[sel], sample_b[sel]
        count_a, count_b = sa.values("sample_count", 0)[sel], sb.values("sample_count", 0)[sel]
        width = min(values_a.shape[1], values_b.shape[1])
        unused = np.arange(width)[None, :] >= count_a[:, None]
        same = (count_a == count_b) & ((positions_a[row_a, :width] == positions_b[row_b, :width]) | unused).all(axis=1)
        if (~same).any():
            notes.append(f"step {step}: {int((~same).sum())} sampled records have different sample positions on "
                         "the two sides; they are compared by their statistics only")
        va = np.where(unused, np.nan, values_a[row_a, :width])[same]
        vb = np.where(unused, np.nan, values_b[row_b, :width])[same]
        for metric, values in sample_metrics(va, vb).items():
            rows[metric][sel[same]] = values
        rows["evidence"][sel[same]] = "sample"
    return notes


def _fill_tensors(rows: Table, sa: _Side, sb: _Side, mask: np.ndarray, a: Dump, b: Dump,
                  advance: Callable[[], None]) -> None:
    """Stream every tensor pair, chunk by chunk."""
    paths_a, paths_b = sa.values("tensor", ""), sb.values("tensor", "")
    use = np.flatnonzero(mask & (paths_a != "") & (paths_b != ""))
    sums, trim = np.empty((len(use), len(FIELDS))), HeapTrimmer()
    for k, i in enumerate(use):
        sums[k] = tensor_sums(a.tensor(int(sa.rows[i])), b.tensor(int(sb.rows[i])))
        trim()
        advance()
    for metric, values in metrics_of_sums(sums).items():
        rows[metric][use] = values
    rows["evidence"][use] = "tensor"


def _update_steps(rows: Table, a: Dump, ia: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """How far the optimizer may move an element (arguments.adam_step): per row of a recorded
    update, from A's hyper-parameters for it (NaN: not an Adam-family update, or not recorded); per
    parameter row, the sum of A's logged learning rates over the steps before it (NaN where a step
    has none), for the updates that were not recorded."""
    n = len(rows)
    step_of_update = np.full(n, np.nan)
    updates = np.flatnonzero((rows["direction"] == "optimizer") & (ia >= 0))
    if len(updates) and a.args_reader is not None:
        calls, steps = a.records["call"][ia[updates]], rows["step"][updates]
        sizes = {key: adam_step(a.args_reader(*key)) for key in set(zip(steps.tolist(), calls.tolist()))}
        step_of_update[updates] = [sizes[key] for key in zip(steps.tolist(), calls.tolist())]
    metrics = a.metrics
    learning_rate_sum = np.full(n, np.nan)
    if len(metrics) and "lr" in metrics:
        logged = dict(zip(metrics["step"].astype(np.int64).tolist(), metrics["lr"].astype(np.float64).tolist()))
        last = max(logged) + 1
        summed = np.concatenate([[0.0], np.cumsum([logged.get(step, np.nan) for step in range(last)])])
        parameters = np.flatnonzero(rows["role"] == "parameter")
        steps = rows["step"][parameters]
        learning_rate_sum[parameters] = np.where(steps <= last, summed[np.minimum(steps, last)], np.nan)
    return step_of_update, learning_rate_sum


def _hyper_parameters(a: Dump, b: Dump) -> list[tuple[str, object, object]]:
    """The optimizer settings that differ, from the first update both sides recorded."""
    if a.args_reader is None or b.args_reader is None:
        return []
    first = []
    for dump in (a, b):
        found = np.flatnonzero(dump.records["direction"] == "optimizer")
        if not len(found):
            return []
        first.append(dump.args_reader(int(dump.records["step"][found[0]]), int(dump.records["call"][found[0]])))
    return hyper_parameter_differences(*first)
