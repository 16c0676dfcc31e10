"""What a call read beyond its recorded inputs: a module call its parameters, a parameter the
optimizer's update of it (or, where that was not recorded, the parameter and gradient of the last
dumped step before), a parameter's gradient what its readers' backward calls sent it.
"""

from __future__ import annotations

import numpy as np

from pi0align.compare.judging.calltable.bounds import (
    dimensions,
    reduction_condition,
)
from pi0align.compare.judging.identity import gradient_sources
from pi0align.compare.judging.modules import enclosing_paths, is_module
from pi0align.compare.reading.records import subjects
from pi0align.compare.table import Groups, Table, gather, lookup


def add_module_parameters(calls: Table, judged: Table, error: np.ndarray, fail: np.ndarray) -> None:
    """A module call also reads its parameters and those of the modules below it, as the step's
    forward first read them (the parameter records): their error is the module call's input error."""
    params = np.flatnonzero(judged.isin("role", "parameter"))
    if not len(params):
        return
    worst: dict[tuple, list] = {}  # (rank, step, module path or an ancestor) -> [error, fail, identical]
    identical = judged["identical"].astype(bool)
    for i in params.tolist():
        parts = str(judged["module"][i]).split(".") if judged["module"][i] else []
        for n in range(len(parts) + 1):
            entry = worst.setdefault((int(judged["rank"][i]), int(judged["step"][i]), ".".join(parts[:n])),
                                     [0.0, False, True])
            entry[0] = max(entry[0], float(0.0 if np.isnan(error[i]) else error[i]))
            entry[1] |= bool(fail[i])
            entry[2] &= bool(identical[i])
    modules = np.flatnonzero(is_module(calls) & calls.isin("direction", "forward"))
    for i in modules.tolist():
        entry = worst.get((int(calls["rank"][i]), int(calls["step"][i]), str(calls["module"][i])))
        if entry is not None:
            for column in ("input_error", "input_summed"):
                calls[column][i] = max(calls[column][i], entry[0])
            calls["inputs_fail"][i] |= entry[1]
            calls["inputs_identical"][i] &= entry[2]


PARAMETER_DIRECTIONS = ("parameter", "gradient", "optimizer")


def parameter_calls(calls: Table, before: Table | None = None) -> Table:
    """Of these calls and `before` (an earlier result of this function), the latest call of each
    parameter, its gradient and its update (PARAMETER_DIRECTIONS), by step: what the next steps'
    parameters read (`call_table`'s `parameters_before`)."""
    mine = calls.take(calls.isin("direction", *PARAMETER_DIRECTIONS))
    both = Table.concat([before.select(mine.columns), mine]) if before is not None else mine
    latest = np.lexsort((-both["step"], both["direction"], subjects(both["name"]), both["rank"]))
    both = both.take(latest)
    return both.take(Groups(both["rank"], subjects(both["name"]), both["direction"]).first)


# what a parameter's call reads of the calls before it (`add_parameter_sources`)
_SOURCE_COLUMNS = ["rank", "step", "direction", "name", "output_error", "outputs_fail", "outputs_differ"]


def add_parameter_sources(calls: Table, before: Table | None, noisy_start: bool) -> None:
    """A parameter's input is the optimizer's update of it at the step before. Where that update
    was not recorded, the parameter stands for it: its inputs are the parameter and its gradient
    at the last dumped step before (`previous_step`). At a parameter's first dumped step it has no
    input (the weights were given), unless that step is past 0 and the runs started from the same
    weights but compute differently (`noisy_start`): then it stands for the updates since step 0
    (`previous_step` 0 and `from_start`), whose gradients were not dumped; the gradient of its own
    step tells their error. `before`: calls of earlier steps (`parameter_calls`)."""
    own = len(calls)
    param = np.flatnonzero(calls.isin("direction", "parameter"))
    if not len(param):
        return
    known = calls.select(_SOURCE_COLUMNS)  # these calls, then those before them
    if before is not None and len(before):
        known = Table.concat([known, before.select(_SOURCE_COLUMNS)])
    parameter = subjects(known["name"])
    rank, step, direction = known["rank"], known["step"], known["direction"]
    made_by = {(int(rank[i]), int(step[i]), parameter[i]): i for i in np.flatnonzero(direction == "optimizer").tolist()}
    gradient_of = {(int(rank[i]), int(step[i]), parameter[i]): i
                   for i in np.flatnonzero(direction == "gradient").tolist()}
    # (rank, parameter) -> the call of its last dumped step so far, starting from the steps before
    seen = {(int(rank[i]), parameter[i]): i for i in (np.flatnonzero(direction[own:] == "parameter") + own).tolist()}
    for i in param[np.lexsort((step[param], rank[param]))].tolist():
        key = (int(rank[i]), parameter[i])
        last, seen[key] = seen.get(key), i
        source = made_by.get((key[0], int(step[i]) - 1, key[1]))
        if source is not None:
            sources = [source]
        elif last is not None:  # the update between the two dumped steps, not recorded
            calls["previous_step"][i] = step[last]
            grad = gradient_of.get((key[0], int(step[last]), key[1]))
            sources = [last] + ([grad] if grad is not None else [])
        elif noisy_start and step[i] > 0:
            calls["previous_step"][i], calls["from_start"][i] = 0, True
            grad = gradient_of.get((key[0], int(step[i]), key[1]))
            sources = [grad] if grad is not None else []
        else:
            continue
        calls["input_error"][i] = max([0.0] + [known["output_error"][s] for s in sources])
        calls["inputs_fail"][i] = any(known["outputs_fail"][s] for s in sources)
        # from the start, the gradients of the steps before are not known to agree
        calls["inputs_identical"][i] = (last is not None or source is not None) and \
            not any(known["outputs_differ"][s] for s in sources)


def add_gradient_sources(calls: Table, rows: Table, identity: np.ndarray, error: np.ndarray,
                          failing: np.ndarray) -> None:
    """A parameter's gradient is the sum of what its readers' backward calls sent it (identity.py);
    where none of them was dumped (a dump at level module), the module owning the parameter
    computed it: the input error of that module's backward call, or where that module was not
    dumped either (filtered out), of the innermost dumped module around it, which ran its code."""
    gradient = np.flatnonzero(calls.isin("direction", "gradient"))
    if not len(gradient):
        return
    bound, readers_fail = gradient_sources(rows, identity, error, failing)
    grad_rows = np.flatnonzero(rows.isin("role", "parameter_grad"))
    keys = ("rank", "step", "name")
    at = lookup([calls[k][gradient] for k in keys], [rows[k][grad_rows] for k in keys])
    row = np.where(at >= 0, grad_rows[np.maximum(at, 0)], -1)
    calls["input_error"][gradient] = gather(bound, row, np.nan)
    calls["inputs_fail"][gradient] = gather(readers_fail, row, False)
    calls["inputs_identical"][gradient] = False
    unknown = gradient[np.isnan(calls["input_error"][gradient])]
    if not len(unknown):
        return
    backward_modules = np.flatnonzero(is_module(calls) & calls.isin("direction", "backward"))
    owner = _owning_module_calls(calls, unknown, backward_modules)
    found = owner >= 0
    module_call = backward_modules[owner[found]]
    calls["input_error"][unknown[found]] = calls["input_error"][module_call]
    calls["inputs_fail"][unknown[found]] = calls["inputs_fail"][module_call]
    calls["condition"][unknown[found]] = _reduction_conditions(calls, rows, unknown[found], module_call)
    calls["condition_rule"][unknown[found]] = "gradient sum"
    calls["input_error"][unknown[~found]] = np.inf
    calls["sourced"][unknown[~found]] = False


def _owning_module_calls(calls: Table, gradients: np.ndarray, backward_modules: np.ndarray) -> np.ndarray:
    """Per parameter gradient, the backward call among `backward_modules` (its index there) of the
    module owning the parameter, else of the innermost module around it that has one; -1: none."""
    keys = zip(*(calls[k][backward_modules].tolist() for k in ("rank", "step", "module")))
    call_of = {key: i for i, key in reversed(list(enumerate(keys)))}  # the first call of a module
    rank, step, module = (calls[k][gradients].tolist() for k in ("rank", "step", "module"))
    return np.array([next((call_of[key] for path in reversed(enclosing_paths(str(m)))
                           if (key := (r, s, path)) in call_of), -1)
                     for r, s, m in zip(rank, step, module)], np.int64)


def _reduction_conditions(calls: Table, rows: Table, gradients: np.ndarray, owners: np.ndarray) -> np.ndarray:
    """The condition of a parameter's gradient as its module's backward computes it, a sum over the
    positions of the module's input X of the gradient G flowing in, by the triangle inequality:
    ‖G‖ ‖X‖ / ‖∂W‖ for a weight (G^T X), bounds.reduction_condition for a bias-like parameter (one
    value per feature)."""
    def record(calls_at: np.ndarray, direction: str, role: str) -> np.ndarray:
        keys = [calls[k][calls_at] for k in ("rank", "step", "name")]
        found = lookup(keys + [np.full(len(calls_at), direction, object), np.full(len(calls_at), role, object),
                               np.zeros(len(calls_at), np.int64)],
                       [rows[k] for k in ("rank", "step", "name", "direction", "role", "arg_index")])
        return found

    norm = rows["norm_a"].astype(np.float64)
    incoming, saved_input = record(owners, "backward", "grad_output"), record(owners, "forward", "input")
    keys = [calls[k][gradients] for k in ("rank", "step", "name")]
    own = lookup(keys + [np.full(len(gradients), "parameter_grad", object)],
                 [rows[k] for k in ("rank", "step", "name", "role")])
    condition = np.ones(len(gradients))
    for i, (g, x, w) in enumerate(zip(incoming.tolist(), saved_input.tolist(), own.tolist())):
        if min(g, w) < 0 or not norm[w] > 0:
            continue
        if len(dimensions(str(rows["shape_a"][w])) or ()) >= 2:
            if x >= 0 and np.isfinite(norm[g] * norm[x]):
                condition[i] = max(1.0, norm[g] * norm[x] / norm[w])
        else:
            dims = dimensions(str(rows["shape_a"][g])) or ()
            if dims:
                condition[i] = reduction_condition(norm[g], np.prod(dims), norm[w], dims[-1])
    return condition
