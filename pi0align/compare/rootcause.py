"""Which call introduced the error: error out of a call over error into it.

Error propagates, so once one call diverges every later call does too. A call is to blame when
its inputs agree (pass) and its outputs do not (fail); a call that amplifies an incoming error
by AMPLIFICATION or more is listed too. Forward calls are searched in execution order, backward
calls in the order autograd ran them. A module call is blamed only when no blamed call ran inside
it: its error is then explained by its own code, not by a call it made (mix level records both).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from pi0align.compare.records import INPUT_ROLES, OUTPUT_ROLES
from pi0align.compare.result import CallRef, Culprit
from pi0align.compare.table import Groups, Table, isin, lookup
from pi0align.compare.thresholds import UNIT_ROUNDOFF, looser_classes

STATS_ERRORS = ["norm_rel_err", "mean_val_rel_err", "min_rel_err", "max_val_rel_err"]
AMPLIFICATION = 10.0
MAX_CULPRITS = 100
CALL_COLUMNS = ["rank", "step", "direction", "seq_a", "name", "module", "api", "input_error", "output_error",
                "inputs_pass", "outputs_fail", "introduced_error", "metric"]


def row_error(rows: Table) -> tuple[np.ndarray, np.ndarray]:
    """(error, metric name) per row: relative L2 error where values were compared, else the
    largest relative error of the statistics."""
    rel_l2 = rows["rel_l2_err"].astype(np.float64)
    stats = np.column_stack([rows[m].astype(np.float64) for m in STATS_ERRORS])
    with np.errstate(invalid="ignore"):
        stats_max = np.where(np.isnan(stats).all(axis=1), np.nan,
                             np.nanmax(np.where(np.isnan(stats), -np.inf, stats), axis=1))
    use_values = ~np.isnan(rel_l2)
    return np.where(use_values, rel_l2, stats_max), np.where(use_values, "rel_l2_err", "stats_rel_err")


def call_errors(rows: Table) -> Table:
    """One row per judged call (CALL_COLUMNS), in order of step, seq_a and rank."""
    judged = rows.take(isin(rows["verdict"], ["pass", "warn", "fail"])
                       & isin(rows["direction"], ["forward", "backward"]))
    error, metric = row_error(judged)
    is_in = isin(judged["role"], INPUT_ROLES)
    is_out = isin(judged["role"], OUTPUT_ROLES)
    fail = judged["verdict"] == "fail"
    floor = np.array([UNIT_ROUNDOFF[c] for c in looser_classes(judged["dtype_a"], judged["dtype_b"]).tolist()])
    seq_a = judged["seq_a"].astype(np.int64)
    groups = Groups(judged["rank"], judged["step"], judged["direction"], seq_a)  # one group per call
    first = groups.first
    calls = Table({
        "rank": judged["rank"][first], "step": judged["step"][first], "direction": judged["direction"][first],
        "seq_a": seq_a[first], "name": judged["name"][first], "module": judged["module"][first],
        "api": judged["api"][first],
        "input_error": groups.max(np.where(is_in, np.nan_to_num(error, nan=0.0), 0.0)),
        "output_error": groups.max(np.where(is_out, np.nan_to_num(error, nan=0.0), -np.inf)),
        "inputs_fail": groups.any(is_in & fail), "outputs_fail": groups.any(is_out & fail),
        "floor": groups.max(np.where(is_out, floor, 0.0)),
        "metric": groups.max_text(np.where(is_out, metric, "").astype(object)),
    })
    _add_saved_tensors(calls)
    calls = calls.take(np.isfinite(calls["output_error"]))  # calls with no judged output introduce nothing
    calls["inputs_pass"] = ~calls["inputs_fail"]
    denominator = np.maximum(calls["input_error"], np.where(calls["floor"] > 0, calls["floor"], np.finfo(float).tiny))
    with np.errstate(over="ignore"):
        calls["introduced_error"] = calls["output_error"] / denominator
    return calls.select(CALL_COLUMNS).take(np.lexsort((calls["rank"], calls["seq_a"], calls["step"])))


def _add_saved_tensors(calls: Table) -> None:
    """A backward call also reads what its forward call saved (its inputs and outputs): count the
    forward call's error as input error of the backward call of the same name."""
    forward = calls.take(calls["direction"] == "forward")
    keys = ("rank", "step", "name")
    saved = lookup([calls[k] for k in keys], [forward[k] for k in keys])  # the first forward call of that name
    backward = (calls["direction"] == "backward") & (saved >= 0)
    source = saved[backward]
    saved_error = np.maximum(forward["input_error"][source], forward["output_error"][source])
    calls["input_error"][backward] = np.fmax(calls["input_error"][backward], saved_error)
    calls["inputs_fail"][backward] |= forward["inputs_fail"][source] | forward["outputs_fail"][source]


def first_divergence(calls: Table, direction: str, stack_of: Callable[[int, int, int], list[str]],
                     inputs_must_pass: bool = True) -> CallRef | None:
    """First call of `direction` (in execution order) whose outputs fail and whose inputs pass
    (or, with inputs_must_pass=False, whatever its inputs)."""
    selected = calls["outputs_fail"] & (calls["inputs_pass"] | (not inputs_must_pass))
    candidates = np.flatnonzero((calls["direction"] == direction) & _innermost(calls, selected))
    if not len(candidates):
        return None
    return _ref(CallRef, calls, candidates[0], stack_of)


def culprits(calls: Table, stack_of: Callable[[int, int, int], list[str]]) -> list[Culprit]:
    """Calls that introduce error, earliest step first, most guilty first within a step."""
    guilty = np.flatnonzero(_innermost(calls, calls["outputs_fail"]
                                       & (calls["inputs_pass"] | (calls["introduced_error"] >= AMPLIFICATION))))
    guilty = guilty[np.lexsort((-calls["introduced_error"][guilty], calls["step"][guilty]))][:MAX_CULPRITS]
    return [_ref(Culprit, calls, i, stack_of, introduced_error=float(calls["introduced_error"][i]),
                 input_error=float(calls["input_error"][i]), output_error=float(calls["output_error"][i]),
                 metric=str(calls["metric"][i])) for i in guilty]


def _innermost(calls: Table, selected: np.ndarray) -> np.ndarray:
    """`selected` without the module calls inside which another selected call ran.

    A module invocation at path P spans the later calls (same rank, step, direction) made in P or
    below it, up to the first call elsewhere or P's next invocation. `calls` is in execution order.
    """
    module_api = np.char.startswith(calls["api"].astype(str), "Module.")
    keep = selected.copy()
    modules = calls["module"].astype(str)
    for i in np.flatnonzero(selected & module_api):
        path, seq = modules[i], calls["seq_a"][i]
        later = ((calls["rank"] == calls["rank"][i]) & (calls["step"] == calls["step"][i])
                 & (calls["direction"] == calls["direction"][i]) & (calls["seq_a"] > seq))
        inside = (modules == path) | np.char.startswith(modules, path + ".") if path else np.ones(len(modules), bool)
        ends = later & (~inside | (module_api & (modules == path)))
        end = calls["seq_a"][ends].min() if ends.any() else np.inf
        keep[i] = not (later & inside & (calls["seq_a"] < end) & selected).any()
    return keep


def _ref(cls, calls: Table, i: int, stack_of, **extra):
    rank, step, seq = int(calls["rank"][i]), int(calls["step"][i]), int(calls["seq_a"][i])
    return cls(step=step, name=str(calls["name"][i]), module=str(calls["module"][i]), api=str(calls["api"][i]),
               direction=str(calls["direction"][i]), stack=stack_of(rank, step, seq), rank=rank, **extra)
