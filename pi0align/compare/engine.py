"""compare_dumps: open two runs, pair their records, measure, judge, find the root cause."""

from __future__ import annotations

import gc
import multiprocessing
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from pi0align.compare.judging.explain import explain, rows_of, unexplained_source
from pi0align.compare.judging.groups import culprit_groups
from pi0align.compare.judging.identity import tensor_identities
from pi0align.compare.judging.judge import bit_comparable, judge, noise_model
from pi0align.compare.judging.manifest import (
    manifest_diff,
    manifest_notes,
    numerics_notes,
    weights_comparable,
)
from pi0align.compare.judging.noise import rounding_level
from pi0align.compare.judging.reference import check_reference, reference_notes
from pi0align.compare.judging.rootcause import call_table, culprits, first_divergence, producers
from pi0align.compare.judging.thresholds import load_thresholds
from pi0align.compare.judging.verdict import JUDGED_PAIRINGS, judge_rows
from pi0align.compare.measuring.align import pair_records
from pi0align.compare.measuring.arguments import adam_step, arguments_differ, hyper_parameter_differences
from pi0align.compare.measuring.memory import HeapTrimmer
from pi0align.compare.measuring.metrics import (
    STATS_METRICS,
    TENSOR_METRICS,
    sample_metrics,
    stats_metrics,
    tensor_metrics,
)
from pi0align.compare.reading.open_dump import open_run
from pi0align.compare.reading.records import OUTPUT_ROLES, Dump, user_frames
from pi0align.compare.result import ROW_COLUMNS, Comparison
from pi0align.compare.table import Table, gather, isin, lookup
from pi0align.errors import UserError

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
    paths = [path_a, path_b] + ([noise] if noise is not None else [])
    opened: list[dict[int, Dump]] = []
    try:
        for path in paths:
            opened.append(open_run(path, wanted))
        runs_a, runs_b = opened[0], opened[1]
        for path, runs in zip(paths[1:], opened[1:]):
            if set(runs) != set(runs_a):
                raise UserError(f"the runs have different ranks: {sorted(runs_a)} in {path_a}, "
                                f"{sorted(runs)} in {path}")
        if wanted is not None:
            for path, runs in zip(paths, opened):
                if all(not len(run.records) for run in runs.values()):
                    listed = ", ".join(map(str, sorted(wanted)[:10]))
                    raise UserError(f"{path} holds none of the steps asked for ({listed})")
        _check_steps_in_common(opened, paths)
        if noise is not None:
            check_reference(runs_a, opened[2], path_a, noise)
        replay &= all(runs[r].mode == "tensor" for runs in (runs_a, runs_b) for r in runs)
        pairs = [(runs_a[r], runs_b[r], replay) for r in sorted(runs_a)]
        if noise is not None:
            pairs += [(runs_a[r], opened[2][r], False) for r in sorted(runs_a)]
        tracker = _Tracker(progress, sum(_work(a, b, replay) for a, b, replay in pairs))
        parts = _compare_pairs(pairs, wanted, tracker)
        reference = Table.concat([p[0] for p in parts[len(runs_a):]]) if noise is not None else None
        return _conclude(parts[:len(runs_a)], runs_a, runs_b, thresholds, str(path_a), str(path_b),
                         reference, opened[2] if noise is not None else None)
    finally:
        for runs in opened:
            _close(runs)


PAIRED = ("matched", "realigned", "shape_mismatch", "dtype_mismatch")  # a record with its counterpart


def _check_steps_in_common(opened: list[dict[int, Dump]], paths: list) -> None:
    """Two dumps with no step in common have nothing to compare: never "aligned"."""
    steps = []
    for path, runs in zip(paths, opened):
        held = {int(s) for run in runs.values() for s in np.unique(run.records["step"])}
        if not held:
            notes = [n for run in runs.values() for n in run.notes]
            raise UserError(f"{path} holds no complete dumped step" + (f" ({notes[0]})" if notes else ""))
        steps.append(held)
    if not set.intersection(*steps):
        raise UserError(f"no step in common: {paths[0]} holds steps {_listed(steps[0])}, {paths[1]} steps "
                        f"{_listed(steps[1])} (runs are compared at the same steps: give both the same --dump-steps)")


def _listed(steps: set[int]) -> str:
    ordered = sorted(steps)
    return ", ".join(map(str, ordered[:5])) + (f", ... ({len(ordered)} in all)" if len(ordered) > 5 else "")


def _check_something_matched(rows: Table, source_a: str, source_b: str) -> None:
    """Dumps in which no record pairs with one of the other (other models, other names) are not
    two runs of one training: never "aligned"."""
    if isin(rows["pairing"], PAIRED).any():
        return
    example = {side: next(iter(rows["name"][rows["pairing"] == f"only_{side}"]), "nothing") for side in "ab"}
    raise UserError(f"no record of {source_a} pairs with one of {source_b} in the steps they share: A's calls are "
                    f"named like {example['a']!r}, B's like {example['b']!r} (dumps of different models?)")


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


def _work(a: Dump, b: Dump, replay: bool) -> int:
    """Units of progress: one per step, plus one per tensor pair to stream and per call to replay."""
    steps = len(set(a.records["step"].tolist()) | set(b.records["step"].tolist()))
    tensors = int((a.records["tensor"] != "").sum()) if a.mode == b.mode == "tensor" else 0
    calls = len(set(zip(a.records["step"].tolist(), a.records["call"].tolist()))) if replay else 0
    return steps + tensors + calls


def _compare_pairs(pairs: list[tuple[Dump, Dump, bool]], wanted: set[int] | None,
                   tracker: _Tracker) -> list[tuple[Table, list[str], list]]:
    """Each rank pair measured (_compare_rank): here where there is one pair or one core, else in
    processes of their own, one pair each, as many at once as there are cores (each opens its
    pair again by path: open dumps do not cross processes)."""
    workers = min(len(pairs), os.cpu_count() or 1)
    if workers < 2 or not _main_importable():
        return [_compare_rank(a, b, tracker, replay) for a, b, replay in pairs]
    context = multiprocessing.get_context("spawn")  # a fork would share the open HDF5 files
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
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
    opened = [open_run(source, wanted) for source in (source_a, source_b)]
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
    steps = rows["step"]
    results, trim = [], HeapTrimmer()
    for i in use:
        results.append(tensor_metrics(a.tensor_reader(int(steps[i]), paths_a[i]),
                                      b.tensor_reader(int(steps[i]), paths_b[i])))
        trim()
        advance()
    for metric in TENSOR_METRICS:
        rows[metric][use] = [r[metric] for r in results]
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


def _stack_lookup(dump: Dump) -> Callable[[int, int], list[str]]:
    """(step, seq) -> user frames of the call, for the culprit report; made when asked (few are)."""
    records = dump.records
    call_of = dict(zip(zip(records["step"].tolist(), records["seq"].tolist()), records["call"].tolist()))

    def stack(step: int, seq: int) -> list[str]:
        call = call_of.get((step, seq))
        return [] if call is None else user_frames(dump.stacks.get((step, call), []))

    return stack


def _conclude(parts, runs_a, runs_b, thresholds, source_a: str, source_b: str, reference: Table | None,
              runs_reference: dict[int, Dump] | None) -> Comparison:
    """The verdict in stages, each a function of the ones before: rows against their limits
    (verdict.py), the call table (rootcause.py), the judgement of each call (judge.py), and which
    failing rows the noise model explains (explain.py)."""
    rows = Table.concat([p[0] for p in parts])
    _check_something_matched(rows, source_a, source_b)
    notes = [n for dump in list(runs_a.values()) + list(runs_b.values()) for n in dump.notes]
    notes += [n for p in parts for n in p[1]]
    stack_lookups = {rank: _stack_lookup(dump) for rank, dump in runs_a.items()}  # rank -> (step, seq) -> frames
    first_a, first_b = runs_a[min(runs_a)], runs_b[min(runs_b)]
    diff = manifest_diff(first_a.manifest, first_b.manifest)

    judged_rows = judge_rows(rows, thresholds, reference)
    rounding, rounding_notes = rounding_level(rows, judged_rows.verdict)
    rows["identical"] = judged_rows.identical
    identity = tensor_identities(rows)
    producer = producers(rows, judged_rows.verdict, identity)
    calls = call_table(rows, judged_rows.verdict, rounding, identity, producer)
    fallback = "reference" if reference is not None else "intrinsic"
    judgement = judge(calls, fallback, exact=bit_comparable(rows, judged_rows.identical, diff, first_a.manifest))
    explanation = explain(rows, judged_rows.verdict, rounding, identity, producer, calls, judgement)

    rows["severity"], rows["over_dtype_limits"] = judged_rows.severity, judged_rows.over_dtype_limits
    rows["verdict"], rows["explained_by"] = explanation.verdict, explanation.explained_by
    exact = rows_of(rows, calls, judgement.culprit & (judgement.evidence == "exact"))
    # a change its statistics may not see
    rows["verdict"][exact & isin(rows["role"], OUTPUT_ROLES) & ~rows["identical"]] = "fail"
    rows["introduced_error"] = _introduced_per_row(rows, calls)
    notes += rounding_notes
    if runs_reference is not None:
        notes += reference_notes(runs_reference)
    stack_of = lambda rank, step, seq: stack_lookups[rank](step, seq) if rank in stack_lookups else []
    first = first_divergence(calls, judgement.culprit, stack_of)
    first_bwd = first_divergence(calls, judgement.culprit, stack_of, direction="backward")
    notes += manifest_notes(diff) + numerics_notes(first_a.manifest, first_b.manifest)
    notes += _coverage_notes(rows)
    hyper_parameters = parts[0][2] if parts else []
    if hyper_parameters:
        notes.append("the optimizer's hyper-parameters differ: " + ", ".join(
            f"{key} {va!r} in A, {vb!r} in B" for key, va, vb in hyper_parameters))
    verdict, pairing = rows["verdict"], rows["pairing"]
    failed = bool((verdict == "fail").any())
    # different initial weights make every later agreement accidental: never "aligned"
    weights_differ = _weights_differ(diff) or bool(
        (judgement.culprit & (calls["kind"] == "initial_weights")).any())
    coverage = {"matched": int(isin(pairing, PAIRED).sum()),
                "only_a": int((pairing == "only_a").sum()), "only_b": int((pairing == "only_b").sum())}
    coverage.update({label: int((pairing == label).sum())
                     for label in ("realigned", "shape_mismatch", "dtype_mismatch")})
    if failed and first is None:
        first, note = unexplained_source(rows, calls, stack_of)
        notes.append(note)
    order = np.lexsort((rows["seq_b"], rows["seq_a"], rows["step"], rows["rank"]))  # NaN (no record) last
    return Comparison(
        verdict="diverged" if failed or weights_differ or judgement else "aligned",
        rows=rows.select(ROW_COLUMNS).take(order),
        coverage=coverage, first_divergence=first, culprits=culprits(calls, judgement, stack_of),
        thresholds=thresholds, source_a=source_a, source_b=source_b,
        metrics_a=first_a.metrics, metrics_b=first_b.metrics, manifest_diff=diff, notes=notes,
        first_divergence_backward=first_bwd,
        noise_model=noise_model(judgement, fallback),
        rows_over_dtype_limits=int(rows["over_dtype_limits"].sum()),
        culprit_groups=culprit_groups(calls, judgement, hyper_parameters),
        explained=explanation.counts(), rank_verdicts=_rank_verdicts(rows, calls, judgement))


def _rank_verdicts(rows: Table, calls: Table, judgement) -> dict[int, str]:
    """Per rank: diverged where a row of it still fails or a culprit ran on it."""
    ranks = sorted(set(rows["rank"].tolist()))
    failing = set(rows["rank"][rows["verdict"] == "fail"].tolist()) | set(calls["rank"][judgement.culprit].tolist())
    return {rank: "diverged" if rank in failing else "aligned" for rank in ranks}


def _introduced_per_row(rows: Table, calls: Table) -> np.ndarray:
    """The call's introduced error on its output rows, NaN elsewhere."""
    keys = ("rank", "step", "direction")
    call = lookup([*(rows[k] for k in keys), rows["seq_a"]],
                  [*(calls[k] for k in keys), calls["seq_a"].astype(np.float64)])
    return np.where(isin(rows["role"], OUTPUT_ROLES), gather(calls["introduced_error"], call, np.nan), np.nan)


def _weights_differ(diff: list) -> bool:
    """The manifests' weights hashes differ, taken in the same dtype (in another dtype the same
    initial weights hash apart: the parameter records tell instead)."""
    return weights_comparable(diff) and any(key == "weights_sha256" and None not in (va, vb) for key, va, vb in diff)


def _coverage_notes(rows: Table) -> list[str]:
    notes = []
    for label, side in (("only_a", "A"), ("only_b", "B")):
        count = int((rows["pairing"] == label).sum())
        if count:
            notes.append(f"{count} records only in {side} (listed as {label})")
    return notes
