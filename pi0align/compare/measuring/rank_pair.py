"""One rank's records of two dumps paired and measured: the rows the judging stages read.

Each row is a record and its counterpart (align.py), with the metrics its evidence allows:
statistics, samples, or full tensors streamed (or replayed, replayed.py), the arguments its call
was given, and what the optimizer may have moved it by.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

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
from pi0align.compare.reading.records import Dump
from pi0align.compare.result import COMPARABLE
from pi0align.compare.table import Coded, Table, concatenated, gather


@dataclass(frozen=True)
class MeasuredRank:
    """One rank's measured rows (metrics filled, not yet judged), the notes measuring them left,
    and the optimizer settings that differ (arguments.hyper_parameter_differences)."""

    rows: Table
    notes: tuple[str, ...]
    hyper_parameters: tuple[tuple[str, object, object], ...]


@dataclass(frozen=True)
class MeasuredWindow:
    """A window's (or a group of its ranks') measured pairs, as the Conclusion judges them: each
    rank's of A and B, the window's dumps (open while it is judged), and the noise reference's rows
    (None without one)."""

    ranks: tuple[MeasuredRank, ...]
    runs_a: dict[int, Dump]
    runs_b: dict[int, Dump]
    reference: Table | None


def work_units(a: Dump, b: Dump, replay: bool) -> int:
    """Units of progress: one per step, plus one per tensor pair to stream and per call to replay."""
    steps = len(set(a.records["step"].tolist()) | set(b.records["step"].tolist()))
    tensors = int((a.records["tensor"] != "").sum()) if a.mode == b.mode == "tensor" else 0
    calls = len(set(zip(a.records["step"].tolist(), a.records["call"].tolist()))) if replay else 0
    return steps + tensors + calls


def measure_rank_pair(a: Dump, b: Dump, replay: bool, advance: Callable[[int], None] = lambda n: None
                      ) -> MeasuredRank:
    """One rank's records of two dumps paired and measured (with `replay`, each call of full-tensor
    dumps replayed too); `advance(n)`: n more units of progress (`work_units`) made."""
    ra, rb = a.records, b.records
    pairs = pair_records(ra, rb)
    ia, ib = pairs["ia"], pairs["ib"]
    side_a, side_b = _Side(ra, ia), _Side(rb, ib)
    either = np.where(ia >= 0, ia, len(ra) + ib)  # a's record where there is one, else b's
    pick = lambda column: np.concatenate([ra[column], rb[column]])[either]
    picked_coded = lambda column: concatenated(ra.coded(column), rb.coded(column)).take(either)
    rows = Table({
        "step": pick("step").astype(np.int64),
        "seq_a": side_a.values("seq", np.nan), "seq_b": side_b.values("seq", np.nan),
        "name": pick("name"), **{column: picked_coded(column) for column in ("module", "api", "direction", "role")},
        "arg_index": pick("arg_index").astype(np.int64),
        **{f"{column}_{side}": values.coded(column, "") for column in ("dtype", "shape")
           for side, values in (("a", side_a), ("b", side_b))},
        "pairing": pairs.coded("pairing"),
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
    comparable = rows.isin("pairing", *COMPARABLE)
    _fill_stats(rows, side_a, side_b, comparable)
    notes = []
    if a.mode == b.mode == "sample" and a.sample_reader and b.sample_reader:
        notes += _fill_samples(rows, side_a, side_b, comparable, a, b)
    done = 0  # units of progress made below

    def advance_one() -> None:
        nonlocal done
        done += 1
        advance(1)

    if replay:  # one pass over the calls: each tensor read once, for its metrics and the replay
        from pi0align.compare.measuring.replayed import measure_and_replay  # imports torch

        for column, values in measure_and_replay(rows, a, b, ia, ib, comparable, advance_one).items():
            rows[column] = values
        rows["evidence"][~np.isnan(rows["rel_l2_err"])] = "tensor"
    else:
        if a.mode == b.mode == "tensor":
            _fill_tensors(rows, side_a, side_b, comparable, a, b, advance_one)
        rows["local_error_a"], rows["local_error_b"] = np.full(len(ia), np.nan), np.full(len(ia), np.nan)
        rows["replay"] = np.full(len(ia), "", dtype=object)
    rows["args_differ"] = arguments_differ(rows, a, b, ia, ib)
    rows["update_step"], rows["learning_rate_sum"] = _update_steps(rows, a, ia)
    advance(max(work_units(a, b, replay) - done, 0))  # steps, unpaired tensors, calls not replayed
    return MeasuredRank(rows, tuple(notes), tuple(_hyper_parameters(a, b)))


class _Side:
    """One side's record of each row, column by column; `missing` where the side has none."""

    def __init__(self, records: Table, rows: np.ndarray):
        self.records, self.rows = records, rows

    def coded(self, column: str, missing: str) -> Coded:
        """A text column, coded (table.Coded)."""
        return self.records.coded(column).gathered(self.rows, missing)

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
    updates = np.flatnonzero(rows.isin("direction", "optimizer") & (ia >= 0))
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
        parameters = np.flatnonzero(rows.isin("role", "parameter"))
        steps = rows["step"][parameters]
        learning_rate_sum[parameters] = np.where(steps <= last, summed[np.minimum(steps, last)], np.nan)
    return step_of_update, learning_rate_sum


def _hyper_parameters(a: Dump, b: Dump) -> list[tuple[str, object, object]]:
    """The optimizer settings that differ, from the first update both sides recorded."""
    if a.args_reader is None or b.args_reader is None:
        return []
    first = []
    for dump in (a, b):
        found = np.flatnonzero(dump.records.isin("direction", "optimizer"))
        if not len(found):
            return []
        first.append(dump.args_reader(int(dump.records["step"][found[0]]), int(dump.records["call"][found[0]])))
    return hyper_parameter_differences(*first)
