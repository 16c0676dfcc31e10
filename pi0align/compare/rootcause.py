"""Per call: the error into it, out of it, and introduced by it (out over in); the first
divergence and the culprits, from the calls that judge.py finds guilty.

Error propagates, so once one call diverges every later call does too: a call introduces error
when its inputs agree (pass) and its outputs do not (fail), or when it amplifies what it receives.
Calls are searched in execution order: a step's parameters, its data, its forward calls, its
backward calls (in the order autograd ran them), its optimizer update.

Not every call is an API's: each has a kind (`kinds`). A parameter's record at a step is a call whose
input is the optimizer's update of it at the step before (none at the first dumped step: its
weights were given); the data are calls without inputs; a module's parameters are inputs of its
calls, so a module is never blamed for the weights it was handed.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from pi0align.compare.judge import Judgement, innermost
from pi0align.compare.records import INPUT_ROLES, OUTPUT_ROLES, subjects
from pi0align.compare.result import CallRef, Culprit
from pi0align.compare.table import Groups, Table, isin, lookup
from pi0align.compare.thresholds import UNIT_ROUNDOFF, dtype_class, looser_classes

STATS_ERRORS = ["norm_rel_err", "mean_val_rel_err", "min_rel_err", "max_val_rel_err"]
MAX_CULPRITS = 100
# kind of culprit by the direction of its records ("parameter": initial_weights or parameters)
KIND_OF_DIRECTION = {"forward": "call", "backward": "call", "optimizer": "optimizer", "data": "data"}
PHASES = ("parameter", "data", "forward", "backward", "optimizer")  # a step's parts in execution order
CALL_COLUMNS = ["rank", "step", "direction", "kind", "seq_a", "name", "module", "api", "input_error", "output_error",
                "inputs_pass", "outputs_fail", "introduced_error", "metric",
                "local_error_a", "local_error_b", "unit_a", "unit_b", "replay", "args_differ", "inputs_identical",
                "outputs_differ"]


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
    judged = rows.take(isin(rows["verdict"], ["pass", "warn", "fail"]) & isin(rows["direction"], PHASES)
                       & (rows["role"] != "parameter_grad"))
    error, metric = row_error(judged)
    is_in = isin(judged["role"], INPUT_ROLES)
    is_out = isin(judged["role"], (*OUTPUT_ROLES, "parameter"))
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
        # replay (replayed.py): each side's largest local error over the call's results, the unit
        # roundoff of its result dtypes, and why it was not replayed
        "local_error_a": groups.max(np.where(is_out, judged["local_error_a"].astype(np.float64), np.nan)),
        "local_error_b": groups.max(np.where(is_out, judged["local_error_b"].astype(np.float64), np.nan)),
        "unit_a": groups.max(np.where(is_out, _units(judged["dtype_a"]), 0.0)),
        "unit_b": groups.max(np.where(is_out, _units(judged["dtype_b"]), 0.0)),
        "replay": groups.max_text(np.where(is_out, judged["replay"], "").astype(object)),
        "args_differ": groups.any(judged["args_differ"].astype(bool)),
        # exact evidence: every input holds the same bits on both sides, some output does not
        "inputs_identical": ~groups.any(is_in & ~judged["identical"].astype(bool)),
        "outputs_differ": groups.any(is_out & ~judged["identical"].astype(bool)),
    })
    first_step = int(rows["step"].min()) if len(rows) else 0
    _add_module_parameters(calls, judged, error)
    _add_parameter_sources(calls, first_step)
    _add_saved_tensors(calls)
    calls = calls.take(np.isfinite(calls["output_error"]))  # calls with no judged output introduce nothing
    calls["kind"] = kinds(calls, first_step)
    calls["inputs_pass"] = ~calls["inputs_fail"]
    denominator = np.maximum(calls["input_error"], np.where(calls["floor"] > 0, calls["floor"], np.finfo(float).tiny))
    with np.errstate(over="ignore"):
        calls["introduced_error"] = calls["output_error"] / denominator
    return calls.select(CALL_COLUMNS).take(np.lexsort((calls["rank"], calls["seq_a"], calls["step"])))


def _units(dtypes: np.ndarray) -> np.ndarray:
    """Unit roundoff of each dtype name ("" = none: 0)."""
    table = {d: UNIT_ROUNDOFF[dtype_class(d)] if d else 0.0 for d in set(dtypes.tolist())}
    return np.array([table[d] for d in dtypes.tolist()], np.float64)


def kinds(calls: Table, first_step: int) -> np.ndarray:
    """Each call's kind: a parameter at step 0 holds the initial weights; later, or at a first
    dumped step past 0, the parameters (what training made of them)."""
    kind = np.array([KIND_OF_DIRECTION.get(d, "parameters") for d in calls["direction"].tolist()], dtype=object)
    kind[(kind == "parameters") & (calls["step"] == 0) & (first_step == 0)] = "initial_weights"
    return kind


def _add_module_parameters(calls: Table, judged: Table, error: np.ndarray) -> None:
    """A module call also reads its parameters and those of the modules below it, as the step's
    forward first read them (the parameter records): their error is the module call's input error."""
    params = np.flatnonzero(judged["role"] == "parameter")
    if not len(params):
        return
    worst: dict[tuple, list] = {}  # (rank, step, module path or an ancestor) -> [error, fail, identical]
    fail, identical = judged["verdict"] == "fail", judged["identical"].astype(bool)
    for i in params.tolist():
        parts = str(judged["module"][i]).split(".") if judged["module"][i] else []
        for n in range(len(parts) + 1):
            entry = worst.setdefault((int(judged["rank"][i]), int(judged["step"][i]), ".".join(parts[:n])),
                                     [0.0, False, True])
            entry[0] = max(entry[0], float(np.nan_to_num(error[i], nan=0.0)))
            entry[1] |= bool(fail[i])
            entry[2] &= bool(identical[i])
    modules = np.flatnonzero(np.char.startswith(calls["api"].astype(str), "Module.")
                             & (calls["direction"] == "forward"))
    for i in modules.tolist():
        entry = worst.get((int(calls["rank"][i]), int(calls["step"][i]), str(calls["module"][i])))
        if entry is not None:
            calls["input_error"][i] = max(calls["input_error"][i], entry[0])
            calls["inputs_fail"][i] |= entry[1]
            calls["inputs_identical"][i] &= entry[2]


def _add_parameter_sources(calls: Table, first_step: int) -> None:
    """A parameter's input is the optimizer's update of it at the step before. At the first dumped
    step it has none (the weights were given); past it without that update dumped (a step not
    dumped, an optimizer not given to the Dumper), what made it is unknown: infinite input error,
    it introduces nothing."""
    param = np.flatnonzero(calls["direction"] == "parameter")
    if not len(param):
        return
    update = np.flatnonzero(calls["direction"] == "optimizer")
    parameter = subjects(calls["name"])
    made_by = {(int(calls["rank"][i]), int(calls["step"][i]), parameter[i]): i for i in update.tolist()}
    for i in param.tolist():
        step = int(calls["step"][i])
        source = made_by.get((int(calls["rank"][i]), step - 1, parameter[i]))
        if source is not None:
            calls["input_error"][i] = calls["output_error"][source]
            calls["inputs_fail"][i] = calls["outputs_fail"][source]
            calls["inputs_identical"][i] = not calls["outputs_differ"][source]
        elif step != first_step:
            calls["input_error"][i], calls["inputs_fail"][i], calls["inputs_identical"][i] = np.inf, True, False


def phases(directions: np.ndarray) -> np.ndarray:
    """Each record's or call's phase of its step (the index of its direction in PHASES): a dump
    may number a step's parameters after its backward calls (msprobe's do), yet they came first."""
    index = {direction: i for i, direction in enumerate(PHASES)}
    return np.array([index.get(d, len(PHASES)) for d in directions.tolist()], np.int64)


def execution_order(calls: Table) -> np.ndarray:
    """The calls in execution order: by step, the step's phase, then sequence."""
    return np.lexsort((calls["seq_a"], phases(calls["direction"]), calls["step"]))


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
    calls["inputs_identical"][backward] &= forward["inputs_identical"][source] & ~forward["outputs_differ"][source]


def first_divergence(calls: Table, guilty: np.ndarray, stack_of: Callable[[int, int, int], list[str]],
                     direction: str | None = None) -> CallRef | None:
    """First call in execution order among `guilty` (of `direction` only, when given)."""
    order = execution_order(calls)
    wanted = guilty if direction is None else guilty & (calls["direction"] == direction)
    candidates = order[wanted[order]]
    if not len(candidates):
        return None
    return _ref(CallRef, calls, candidates[0], stack_of)


def first_failing(calls: Table, stack_of: Callable[[int, int, int], list[str]]) -> CallRef | None:
    """First call whose outputs fail, whatever its inputs (the innermost module)."""
    return first_divergence(calls, innermost(calls, calls["outputs_fail"]), stack_of)


def culprits(calls: Table, judgement: Judgement, stack_of: Callable[[int, int, int], list[str]]) -> list[Culprit]:
    """The guilty calls, earliest step first, then by the step's phase (PHASES: forward before
    backward, as a faulty kernel's backward inherits its forward's fault), most blame first."""
    guilty = np.flatnonzero(judgement.culprit)
    phase = phases(calls["direction"][guilty])
    guilty = guilty[np.lexsort((-judgement.blame[guilty], phase, calls["step"][guilty]))][:MAX_CULPRITS]
    number = lambda column, i: float(calls[column][i])
    return [_ref(Culprit, calls, i, stack_of, introduced_error=number("introduced_error", i),
                 input_error=number("input_error", i), output_error=number("output_error", i),
                 metric=str(calls["metric"][i]), evidence=str(judgement.evidence[i]),
                 wrong_side=str(judgement.wrong_side[i]), local_error_a=number("local_error_a", i),
                 local_error_b=number("local_error_b", i), local_ratio=float(judgement.blame[i])
                 if judgement.evidence[i] == "replay" else float("nan")) for i in guilty]


def _ref(cls, calls: Table, i: int, stack_of, **extra):
    rank, step, seq = int(calls["rank"][i]), int(calls["step"][i]), int(calls["seq_a"][i])
    return cls(step=step, name=str(calls["name"][i]), module=str(calls["module"][i]), api=str(calls["api"][i]),
               direction=str(calls["direction"][i]), stack=stack_of(rank, step, seq), rank=rank,
               kind=str(calls["kind"][i]), **extra)
