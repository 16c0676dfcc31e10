"""compare_dumps: open two runs, pair their records, measure, judge, find the root cause."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import pandas as pd

from pi0align.compare import rootcause
from pi0align.compare.align import pair_records
from pi0align.compare.manifest import manifest_diff, manifest_notes
from pi0align.compare.metrics import STATS_METRICS, TENSOR_METRICS, sample_metrics, stats_metrics, tensor_metrics
from pi0align.compare.noise import noise_driven
from pi0align.compare.open_dump import open_run
from pi0align.compare.records import Dump, user_frames
from pi0align.compare.result import ROW_COLUMNS, Comparison
from pi0align.compare.thresholds import load_thresholds
from pi0align.compare.verdict import JUDGED_PAIRINGS, severity, verdicts
from pi0align.errors import UserError

Progress = Callable[[int, int], None]


def compare_dumps(path_a: str | Path, path_b: str | Path, *, thresholds: dict | None = None,
                  steps: Iterable[int] | None = None, progress: Progress | None = None) -> Comparison:
    """Compare run B (under test, e.g. NPU) against run A (benchmark, e.g. GPU).

    path_a, path_b: a pi0align dump file, a run folder of per-rank dump files, or an msprobe dump
    folder. thresholds: as from load_thresholds() (defaults when None). steps: only these steps.
    progress: called as progress(done, total) while comparing.
    """
    thresholds = thresholds or load_thresholds()
    wanted = set(steps) if steps is not None else None
    runs_a = open_run(path_a, wanted)
    try:
        runs_b = open_run(path_b, wanted)
    except UserError:
        _close(runs_a)
        raise
    try:
        if set(runs_a) != set(runs_b):
            raise UserError(f"the runs have different ranks: {sorted(runs_a)} in {path_a}, {sorted(runs_b)} in {path_b}")
        if wanted is not None:
            for path, runs in ((path_a, runs_a), (path_b, runs_b)):
                if all(run.records.empty for run in runs.values()):
                    listed = ", ".join(map(str, sorted(wanted)[:10]))
                    raise UserError(f"{path} holds none of the steps asked for ({listed})")
        tracker = _Tracker(progress, sum(_work(runs_a[r], runs_b[r]) for r in runs_a))
        parts = [_compare_rank(runs_a[r], runs_b[r], tracker) for r in sorted(runs_a)]
        return _conclude(parts, runs_a, runs_b, thresholds, str(path_a), str(path_b))
    finally:
        _close(runs_a)
        _close(runs_b)


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


def _work(a: Dump, b: Dump) -> int:
    """Units of progress: one per step, plus one per tensor pair to stream."""
    steps = len(set(a.records["step"]) | set(b.records["step"]))
    tensors = int((a.records["tensor"] != "").sum()) if a.mode == b.mode == "tensor" else 0
    return steps + tensors


def _compare_rank(a: Dump, b: Dump, tracker: _Tracker) -> tuple[pd.DataFrame, list[str], dict]:
    """Rows of one rank (metrics filled, not yet judged), notes, and a stack lookup."""
    ra, rb = a.records.reset_index(drop=True), b.records.reset_index(drop=True)
    pairs = pair_records(ra, rb)
    ia, ib = pairs["ia"].to_numpy(), pairs["ib"].to_numpy()
    side_a = ra.reindex(np.where(ia >= 0, ia, -1)).reset_index(drop=True)
    side_b = rb.reindex(np.where(ib >= 0, ib, -1)).reset_index(drop=True)
    has_a = ia >= 0
    pick = lambda column: np.where(has_a, side_a[column].to_numpy(object), side_b[column].to_numpy(object))
    rows = pd.DataFrame({
        "step": pick("step").astype(np.int64),
        "seq_a": _nullable_int(side_a["seq"], has_a),
        "seq_b": _nullable_int(side_b["seq"], ib >= 0),
        "name": pick("name"), "module": pick("module"), "api": pick("api"), "direction": pick("direction"),
        "role": pick("role"), "arg_index": pick("arg_index").astype(np.int64),
        "dtype_a": _text(side_a["dtype"]), "dtype_b": _text(side_b["dtype"]),
        "shape_a": _text(side_a["shape"]), "shape_b": _text(side_b["shape"]),
        "pairing": pairs["pairing"].to_numpy(object),
        "evidence": "", "stack": pick("stack"), "rank": a.rank,
        # internal, not in ROW_COLUMNS: for the rounding-noise rule (noise.py)
        "norm_a": side_a["norm"].to_numpy(np.float64), "norm_b": side_b["norm"].to_numpy(np.float64),
        "checksum_a": side_a["checksum"].fillna(-1).to_numpy(np.int64),
    })
    for metric in TENSOR_METRICS + STATS_METRICS:
        rows[metric] = np.nan
    comparable = rows["pairing"].isin(JUDGED_PAIRINGS).to_numpy()
    _fill_stats(rows, side_a, side_b, comparable)
    notes = []
    if a.mode == b.mode == "sample" and a.sample_reader and b.sample_reader:
        notes += _fill_samples(rows, side_a, side_b, comparable, a, b)
    streamed = _fill_tensors(rows, side_a, side_b, comparable, a, b, tracker) if a.mode == b.mode == "tensor" else 0
    tracker.advance(_work(a, b) - streamed)  # the steps, and tensors that had no partner
    return rows, notes, _stack_lookup(a, ra)


def _nullable_int(values: pd.Series, present: np.ndarray) -> pd.Series:
    return pd.Series(np.where(present, values.fillna(0), 0).astype(np.int64), dtype="Int64").mask(~present)


def _text(values: pd.Series) -> np.ndarray:
    """Strings, "" where the side has no record."""
    return np.where(values.isna(), "", values.astype(object))


def _fill_stats(rows: pd.DataFrame, sa: pd.DataFrame, sb: pd.DataFrame, mask: np.ndarray) -> None:
    keys = ("min", "max", "mean", "norm", "numel")
    errors = stats_metrics({k: sa[k].to_numpy(np.float64) for k in keys}, {k: sb[k].to_numpy(np.float64) for k in keys})
    for metric, values in errors.items():
        rows.loc[mask, metric] = values[mask]
    with np.errstate(invalid="ignore"):
        mismatch = (np.abs(sa["nan_count"].to_numpy(np.float64) - sb["nan_count"].to_numpy(np.float64))
                    + np.abs(sa["inf_count"].to_numpy(np.float64) - sb["inf_count"].to_numpy(np.float64)))
    rows.loc[mask, "nan_inf_mismatch"] = mismatch[mask]
    rows.loc[mask, "evidence"] = "stats"


def _fill_samples(rows, sa, sb, mask, a: Dump, b: Dump) -> list[str]:
    notes = []
    use = mask & (sa["sample_row"].to_numpy(np.float64) >= 0) & (sb["sample_row"].to_numpy(np.float64) >= 0)
    for step in np.unique(rows["step"].to_numpy()[use]):
        sel = np.flatnonzero(use & (rows["step"].to_numpy() == step))
        values_a, positions_a = a.sample_reader(int(step))
        values_b, positions_b = b.sample_reader(int(step))
        row_a, row_b = sa["sample_row"].fillna(-1).to_numpy(np.int64)[sel], sb["sample_row"].fillna(-1).to_numpy(np.int64)[sel]
        count_a, count_b = sa["sample_count"].fillna(0).to_numpy(np.int64)[sel], sb["sample_count"].fillna(0).to_numpy(np.int64)[sel]
        width = min(values_a.shape[1], values_b.shape[1])
        unused = np.arange(width)[None, :] >= count_a[:, None]
        same = (count_a == count_b) & ((positions_a[row_a, :width] == positions_b[row_b, :width]) | unused).all(axis=1)
        if (~same).any():
            notes.append(f"step {step}: {int((~same).sum())} sampled records have different sample positions on "
                         "the two sides; they are compared by their statistics only")
        va = np.where(unused, np.nan, values_a[row_a, :width])[same]
        vb = np.where(unused, np.nan, values_b[row_b, :width])[same]
        for metric, values in sample_metrics(va, vb).items():
            rows.loc[sel[same], metric] = values
        rows.loc[sel[same], "evidence"] = "sample"
    return notes


def _fill_tensors(rows, sa, sb, mask, a: Dump, b: Dump, tracker: _Tracker) -> int:
    """Stream every tensor pair; returns how many."""
    paths_a, paths_b = _text(sa["tensor"]), _text(sb["tensor"])
    use = np.flatnonzero(mask & (paths_a != "") & (paths_b != ""))
    steps = rows["step"].to_numpy()
    results = []
    for i in use:
        results.append(tensor_metrics(a.tensor_reader(int(steps[i]), paths_a[i]),
                                      b.tensor_reader(int(steps[i]), paths_b[i])))
        tracker.advance()
    for metric in TENSOR_METRICS:
        rows.loc[use, metric] = [r[metric] for r in results]
    rows.loc[use, "evidence"] = "tensor"
    return len(use)


def _stack_lookup(dump: Dump, records: pd.DataFrame) -> dict[tuple[int, int], list[str]]:
    """(step, seq) -> frames of the call, for the culprit report."""
    calls = records[["step", "seq", "call"]].drop_duplicates()
    return {(int(s), int(q)): user_frames(dump.stacks.get((int(s), int(c)), []))
            for s, q, c in calls.itertuples(index=False)}


def _conclude(parts, runs_a, runs_b, thresholds, source_a: str, source_b: str) -> Comparison:
    rows = pd.concat([p[0] for p in parts], ignore_index=True) if parts else pd.DataFrame(columns=ROW_COLUMNS)
    notes = [n for dump in list(runs_a.values()) + list(runs_b.values()) for n in dump.notes]
    notes += [n for p in parts for n in p[1]]
    stacks = {(rank, *key): frames for rank, p in zip(sorted(runs_a), parts) for key, frames in p[2].items()}
    sev = severity(rows, thresholds)
    rows["severity"] = sev
    rows["verdict"] = verdicts(rows, sev, thresholds)
    driven, noise_notes = noise_driven(rows, thresholds)
    rows.loc[driven, "verdict"] = "warn"
    notes += noise_notes
    calls = rootcause.call_errors(rows)
    rows["introduced_error"] = _introduced_per_row(rows, calls)
    stack_of = lambda rank, step, seq: stacks.get((rank, step, seq), [])
    first_fwd = rootcause.first_divergence(calls, "forward", stack_of)
    first_bwd = rootcause.first_divergence(calls, "backward", stack_of)
    first_a, first_b = runs_a[min(runs_a)], runs_b[min(runs_b)]
    diff = manifest_diff(first_a.manifest, first_b.manifest)
    notes += manifest_notes(diff) + _parameter_notes(rows) + _coverage_notes(rows)
    failed = bool((rows["verdict"] == "fail").any())
    # different initial weights make every later agreement accidental: never "aligned"
    first_step = rows["step"].min() if len(rows) else 0
    weights_differ = any(key == "weights_sha256" and None not in (va, vb) for key, va, vb in diff) or bool(
        ((rows["role"] == "parameter") & (rows["verdict"] == "fail") & (rows["step"] == first_step)).any())
    coverage = {"matched": int(rows["pairing"].isin(["matched", "realigned", "shape_mismatch", "dtype_mismatch"]).sum()),
                "only_a": int((rows["pairing"] == "only_a").sum()), "only_b": int((rows["pairing"] == "only_b").sum())}
    coverage.update({label: int((rows["pairing"] == label).sum())
                     for label in ("realigned", "shape_mismatch", "dtype_mismatch")})
    first = first_fwd or first_bwd
    if failed and first is None:
        first = (rootcause.first_divergence(calls, "forward", stack_of, inputs_must_pass=False)
                 or rootcause.first_divergence(calls, "backward", stack_of, inputs_must_pass=False))
        if first is not None:
            notes.append(f"no call has agreeing inputs and differing outputs: the first differing call, {first.name} "
                         f"(step {first.step}), already receives differing inputs (input data, initial weights, "
                         "or an operation that was not dumped differ)")
    return Comparison(
        verdict="diverged" if failed or weights_differ else "aligned",
        rows=rows[ROW_COLUMNS].sort_values(["rank", "step", "seq_a", "seq_b"], kind="stable",
                                           na_position="last").reset_index(drop=True) if len(rows) else rows.reindex(columns=ROW_COLUMNS),
        coverage=coverage, first_divergence=first, culprits=rootcause.culprits(calls, stack_of),
        thresholds=thresholds, source_a=source_a, source_b=source_b,
        metrics_a=first_a.metrics, metrics_b=first_b.metrics, manifest_diff=diff, notes=notes,
        first_divergence_backward=first_bwd)


def _introduced_per_row(rows: pd.DataFrame, calls: pd.DataFrame) -> np.ndarray:
    """The call's introduced error on its output rows, NaN elsewhere."""
    keys = ["rank", "step", "direction", "seq_a"]
    lookup = rows[keys].astype({"seq_a": "float64"}).merge(
        calls[keys + ["introduced_error"]].astype({"seq_a": "float64"}), on=keys, how="left")
    is_output = rows["role"].isin(rootcause.OUTPUT_ROLES).to_numpy()
    return np.where(is_output, lookup["introduced_error"].to_numpy(np.float64), np.nan)


def _parameter_notes(rows: pd.DataFrame) -> list[str]:
    params = rows[(rows["role"] == "parameter") & (rows["verdict"] == "fail")]
    if params.empty:
        return []
    first_step = int(rows["step"].min())
    step = int(params["step"].min())
    count = int((params["step"] == step).sum())
    what = "initial parameters differ" if step == first_step else "parameters differ"
    return [f"{what}: {count} parameter tensors fail at step {step} (e.g. {params.iloc[0]['name']})"]


def _coverage_notes(rows: pd.DataFrame) -> list[str]:
    notes = []
    for label, side in (("only_a", "A"), ("only_b", "B")):
        count = int((rows["pairing"] == label).sum())
        if count:
            notes.append(f"{count} records only in {side} (listed as {label})")
    return notes
