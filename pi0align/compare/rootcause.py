"""Which call introduced the error: error out of a call over error into it.

Error propagates, so once one call diverges every later call does too. A call is to blame when
its inputs agree (pass) and its outputs do not (fail); a call that amplifies an incoming error
by AMPLIFICATION or more is listed too. Forward calls are searched in execution order, backward
calls in the order autograd ran them.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import pandas as pd

from pi0align.compare.records import INPUT_ROLES, OUTPUT_ROLES
from pi0align.compare.result import CallRef, Culprit
from pi0align.compare.thresholds import UNIT_ROUNDOFF, looser_classes

STATS_ERRORS = ["norm_rel_err", "mean_val_rel_err", "min_rel_err", "max_val_rel_err"]
AMPLIFICATION = 10.0
MAX_CULPRITS = 100


def row_error(rows: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """(error, metric name) per row: relative L2 error where values were compared, else the
    largest relative error of the statistics."""
    rel_l2 = rows["rel_l2_err"].to_numpy(np.float64)
    stats = rows[STATS_ERRORS].to_numpy(np.float64)
    with np.errstate(invalid="ignore"):
        stats_max = np.where(np.isnan(stats).all(axis=1), np.nan,
                             np.nanmax(np.where(np.isnan(stats), -np.inf, stats), axis=1))
    use_values = ~np.isnan(rel_l2)
    return np.where(use_values, rel_l2, stats_max), np.where(use_values, "rel_l2_err", "stats_rel_err")


def call_errors(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per judged call: rank, step, direction, seq_a, name, module, api, input_error,
    output_error, inputs_pass, outputs_fail, introduced_error, metric, first row index."""
    judged = rows[rows["verdict"].isin(["pass", "warn", "fail"]) & rows["direction"].isin(["forward", "backward"])]
    if judged.empty:
        return pd.DataFrame(columns=["rank", "step", "direction", "seq_a", "name", "module", "api", "input_error",
                                     "output_error", "inputs_pass", "outputs_fail", "introduced_error", "metric"])
    error, metric = row_error(judged)
    is_in = judged["role"].isin(INPUT_ROLES).to_numpy()
    is_out = judged["role"].isin(OUTPUT_ROLES).to_numpy()
    fail = (judged["verdict"] == "fail").to_numpy()
    floor = np.array([UNIT_ROUNDOFF[c] for c in looser_classes(judged["dtype_a"], judged["dtype_b"]).tolist()])
    frame = pd.DataFrame({
        "rank": judged["rank"].to_numpy(), "step": judged["step"].to_numpy(),
        "direction": judged["direction"].to_numpy(), "seq_a": judged["seq_a"].to_numpy(np.int64),
        "name": judged["name"].to_numpy(), "module": judged["module"].to_numpy(), "api": judged["api"].to_numpy(),
        "in_err": np.where(is_in, np.nan_to_num(error, nan=0.0), 0.0),
        "out_err": np.where(is_out, np.nan_to_num(error, nan=0.0), -np.inf),
        "in_fail": is_in & fail, "out_fail": is_out & fail,
        "floor": np.where(is_out, floor, 0.0), "metric": np.where(is_out, metric, ""),
    })
    calls = frame.groupby(["rank", "step", "direction", "seq_a"], sort=False).agg(
        name=("name", "first"), module=("module", "first"), api=("api", "first"),
        input_error=("in_err", "max"), output_error=("out_err", "max"), inputs_fail=("in_fail", "any"),
        outputs_fail=("out_fail", "any"), floor=("floor", "max"), metric=("metric", "max")).reset_index()
    calls = _with_saved_tensors(calls)
    calls = calls[np.isfinite(calls["output_error"])]  # calls with no judged output introduce nothing
    calls["inputs_pass"] = ~calls["inputs_fail"]
    denominator = np.maximum(calls["input_error"], calls["floor"].where(calls["floor"] > 0, np.finfo(float).tiny))
    calls["introduced_error"] = calls["output_error"] / denominator
    return calls.drop(columns=["inputs_fail", "floor"]).sort_values(["step", "seq_a", "rank"]).reset_index(drop=True)


def _with_saved_tensors(calls: pd.DataFrame) -> pd.DataFrame:
    """A backward call also reads what its forward call saved (its inputs and outputs): count the
    forward call's error as input error of the backward call of the same name."""
    forward = calls[calls["direction"] == "forward"]
    saved = pd.DataFrame({
        "rank": forward["rank"], "step": forward["step"], "name": forward["name"],
        "saved_error": np.maximum(forward["input_error"], forward["output_error"]),
        "saved_fail": forward["inputs_fail"] | forward["outputs_fail"],
    }).drop_duplicates(["rank", "step", "name"])
    merged = calls.merge(saved, on=["rank", "step", "name"], how="left")
    backward = (merged["direction"] == "backward").to_numpy()
    merged["input_error"] = np.where(backward, np.fmax(merged["input_error"], merged["saved_error"]),
                                     merged["input_error"])
    merged["inputs_fail"] = np.where(backward, merged["inputs_fail"] | merged["saved_fail"].fillna(False).astype(bool),
                                     merged["inputs_fail"])
    return merged.drop(columns=["saved_error", "saved_fail"])


def first_divergence(calls: pd.DataFrame, direction: str, stack_of: Callable[[int, int, int], list[str]],
                     inputs_must_pass: bool = True) -> CallRef | None:
    """First call of `direction` (in execution order) whose outputs fail and whose inputs pass
    (or, with inputs_must_pass=False, whatever its inputs)."""
    selected = calls["outputs_fail"] & (calls["inputs_pass"] | (not inputs_must_pass))
    candidates = calls[(calls["direction"] == direction) & selected]
    if candidates.empty:
        return None
    return _ref(CallRef, candidates.iloc[0], stack_of)


def culprits(calls: pd.DataFrame, stack_of: Callable[[int, int, int], list[str]]) -> list[Culprit]:
    """Calls that introduce error, earliest step first, most guilty first within a step."""
    guilty = calls[calls["outputs_fail"] & (calls["inputs_pass"] | (calls["introduced_error"] >= AMPLIFICATION))]
    guilty = guilty.sort_values(["step", "introduced_error"], ascending=[True, False]).head(MAX_CULPRITS)
    return [_ref(Culprit, row, stack_of, introduced_error=float(row["introduced_error"]),
                 input_error=float(row["input_error"]), output_error=float(row["output_error"]),
                 metric=str(row["metric"])) for _, row in guilty.iterrows()]


def _ref(cls, row: pd.Series, stack_of, **extra):
    rank, step, seq = int(row["rank"]), int(row["step"]), int(row["seq_a"])
    return cls(step=step, name=str(row["name"]), module=str(row["module"]), api=str(row["api"]),
               direction=str(row["direction"]), stack=stack_of(rank, step, seq), rank=rank, **extra)
