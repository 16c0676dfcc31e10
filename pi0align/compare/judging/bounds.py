"""How much output error a call's inputs and its own rounding explain (docs/compare.md, "Bounds").

A call is within its bound when its output error e_out is at most MARGIN × max(C × e_in, F × u):
e_in the largest error among its inputs, C the condition of its API (how much the API itself
grows a relative error; 1 where it does not), u the unit roundoff of its output dtype and F the
number of unit roundoffs its own rounding, and the other side's, may add. `introduced_error` is
e_out / max(C × e_in, F × u): above MARGIN, the call adds error that neither its inputs nor
rounding explain, whatever its inputs hold.

The floors are replay's (judge.py): 3 u in half precision, above a result moved by up to one ulp
(≈ 1.3 u) and its rounding (≈ 0.4 u); 16 u in float32 and float64, room for reduction-order error
over long sums (≈ √K u).
"""

from __future__ import annotations

import functools
import json

import numpy as np

from pi0align.compare.judging.thresholds import UNIT_ROUNDOFF
from pi0align.compare.measuring.arguments import adam_step_for
from pi0align.compare.table import Table, lookup

# An output error up to twice what the inputs and rounding explain is the spread of the measure
# itself (statistics see a tensor's extremes and sums, not its elements); a 3 % fault on an
# input already 0.5 % off introduces 6×.
MARGIN = 2.0
_HALF = (UNIT_ROUNDOFF["bfloat16"], UNIT_ROUNDOFF["float16"])
FLOOR_UNITS_HALF, FLOOR_UNITS = 3.0, 16.0
# APIs whose output sums products over a reduction dimension: their condition is measured (below)
# (their operands' input indexes)
MATMULS = {"linear": (0, 1), "matmul": (0, 1), "__matmul__": (0, 1), "mm": (0, 1), "bmm": (0, 1), "mv": (0, 1),
           "addmm": (1, 2), "baddbmm": (1, 2)}


def noise_floor(unit: np.ndarray) -> np.ndarray:
    """F × u: the error rounding alone may put on a result of unit roundoff u (on both sides)."""
    unit = np.asarray(unit, np.float64)
    return np.where(np.isin(unit, _HALF), FLOOR_UNITS_HALF, FLOOR_UNITS) * unit


def conditions(calls: Table, records: Table, call_of_record: np.ndarray) -> np.ndarray:
    """C per call: 1, except for the matmul family, where a relative error ε of either operand
    becomes ε ‖A‖ ‖B‖ / (√K ‖AB‖) in the product (K the reduction length): 1 for operands of
    independent entries, more where the product cancels (a small output of large operands); and
    for backward calls that sum a gradient over positions (the gradient of a weight or a bias:
    fewer elements out than in), `reduction_condition`; for the calls that select a part of their
    input (SELECTIONS), ‖x‖ / ‖part‖: all of the input's error may sit in the part. `records`: the
    judged records (norm_a, min_a, max_a, shape_a, role, arg_index); `call_of_record`: each
    record's row in `calls`."""
    function = np.array([api.rpartition(".")[2] for api in calls["api"].tolist()], dtype=object)
    condition = np.maximum(_summing_conditions(calls, records, call_of_record),
                           _selection_conditions(calls, records, call_of_record, function))
    matmul = np.flatnonzero(np.isin(function, list(MATMULS)))
    if not len(matmul):
        return condition
    keys = [call_of_record, records["role"], records["arg_index"]]
    operands = np.array([MATMULS[f] for f in function[matmul].tolist()], np.int64).reshape(-1, 2)

    def record(role: str, index: np.ndarray) -> np.ndarray:
        return lookup([matmul, np.full(len(matmul), role, object), index], keys)

    norms, shapes = records["norm_a"].astype(np.float64), records["shape_a"]
    first, second = record("input", operands[:, 0]), record("input", operands[:, 1])
    result = record("output", np.zeros(len(matmul), np.int64))
    for call, i, j, k in zip(matmul.tolist(), first.tolist(), second.tolist(), result.tolist()):
        if min(i, j, k) < 0:
            continue
        reduction = _last_dimension(str(shapes[i]))
        if reduction and norms[k] > 0 and np.isfinite(norms[i] * norms[j]):
            condition[call] = max(1.0, norms[i] * norms[j] / (np.sqrt(reduction) * norms[k]))
    return condition


def step_bounds(calls: Table, records: Table, call_of_record: np.ndarray,
                error: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per optimizer update (recorded, or stood for by the parameter it made), the largest relative
    error its parameter can leave it with: (e_p ‖p‖ + 2 s √n) / ‖p'‖, with e_p the error of the
    parameter it read, ‖p‖ and ‖p'‖ the parameter's norm before and after, n its elements and s the
    most an update moves one element (arguments.adam_step: Adam's step is bounded by the learning
    rate; each side moves an element by at most s, so the two sides by at most 2 s). For updates not
    recorded, s sums the learning rates logged over the steps between, with torch's default betas.
    NaN where the step is not known (not an Adam-family optimizer, no learning rate logged).
    Returns the bounds, and the error of the parameter each update left."""
    bound, left = np.full(len(calls), np.nan), np.full(len(calls), np.nan)
    update = np.flatnonzero(calls["direction"] == "optimizer")
    standing = np.flatnonzero((calls["direction"] == "parameter") & (calls["previous_step"] >= 0))
    if not len(update) and not len(standing):
        return bound, left
    keys = [call_of_record, records["role"], records["arg_index"]]
    norm = records["norm_a"].astype(np.float64)
    numel = np.array([_numel(str(shape)) for shape in records["shape_a"].tolist()], np.float64)

    def record(at: np.ndarray, role: str) -> np.ndarray:
        return lookup([at, np.full(len(at), role, object), np.zeros(len(at), np.int64)], keys)

    before, after = record(update, "input"), record(update, "output")
    step = np.full(len(update), np.nan)
    found = after >= 0
    step[found] = records["update_step"].astype(np.float64)[after[found]]
    # updates not recorded: from the parameter at the dumped step before to this one
    previous = lookup([calls[k][standing] for k in ("rank", "name", "direction")] + [calls["previous_step"][standing]],
                      [calls[k] for k in ("rank", "name", "direction", "step")])
    mine = record(standing, "parameter")
    theirs = np.where(previous >= 0, record(np.maximum(previous, 0), "parameter"), -1)
    rates = records["learning_rate_sum"].astype(np.float64)
    summed = np.where((mine >= 0) & (theirs >= 0), rates[np.maximum(mine, 0)] - rates[np.maximum(theirs, 0)], np.nan)
    at = np.concatenate([update, standing])
    p_before, p_after = np.concatenate([before, theirs]), np.concatenate([after, mine])
    s = np.concatenate([step, summed * adam_step_for(1.0)])
    known = (p_before >= 0) & (p_after >= 0) & np.isfinite(s)
    i, j = p_before[known], p_after[known]
    with np.errstate(divide="ignore", invalid="ignore"):
        moved = np.where(np.isnan(error[i]), 0.0, error[i]) * norm[i] + 2.0 * s[known] * np.sqrt(numel[j])
        bound[at[known]] = np.where(norm[j] > 0, moved / norm[j], np.inf)
    found = p_after >= 0
    left[at[found]] = error[p_after[found]]
    return bound, left


# APIs whose outputs are parts of their first input
SELECTIONS = frozenset({"unbind", "split", "split_with_sizes", "tensor_split", "chunk", "__getitem__", "narrow",
                        "select", "index_select", "gather", "take", "masked_select", "diagonal", "take_along_dim"})


def _selection_conditions(calls: Table, records: Table, call_of_record: np.ndarray, function: np.ndarray) -> np.ndarray:
    """Per selecting call, the largest over its outputs of ‖x‖ / ‖part‖ and max|x| / max|part| (the
    statistics' own scales: the norm's and the extremes'), x its first input; 1 elsewhere."""
    condition = np.ones(len(calls))
    selecting = np.isin(function, list(SELECTIONS)) & (calls["direction"] == "forward")
    if not selecting.any():
        return condition
    on = selecting[call_of_record]
    whole = np.flatnonzero(on & (records["role"] == "input") & (records["arg_index"] == 0))
    parts = np.flatnonzero(on & (records["role"] == "output"))
    of_call = np.full(len(calls), -1, np.int64)
    of_call[call_of_record[whole]] = whole
    x = of_call[call_of_record[parts]]
    parts, x = parts[x >= 0], x[x >= 0]
    norm = records["norm_a"].astype(np.float64)
    largest = np.fmax(np.abs(records["min_a"].astype(np.float64)), np.abs(records["max_a"].astype(np.float64)))
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.fmax(norm[x] / norm[parts], largest[x] / largest[parts])
    ratio = np.where(np.isfinite(ratio), np.maximum(ratio, 1.0), 1.0)
    np.maximum.at(condition, call_of_record[parts], ratio)
    return condition


def reduction_condition(incoming_norm, incoming_numel, result_norm, result_numel) -> np.ndarray:
    """The condition of a gradient summed over positions, g = Σ_p G_p (P = numel(G) / numel(g)
    terms): an error of G may add up alike at every position while the values cancel, so by the
    triangle inequality ‖δg‖ ≤ √P ‖δG‖, and g's relative error is at most √P ‖G‖ / ‖g‖ times G's
    (1 for terms of independent signs, more where the sum cancels)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.sqrt(np.asarray(incoming_numel, np.float64) / np.asarray(result_numel, np.float64))
        condition = ratio * np.asarray(incoming_norm, np.float64) / np.asarray(result_norm, np.float64)
    return np.where(np.isfinite(condition), np.maximum(condition, 1.0), 1.0)


def _summing_conditions(calls: Table, records: Table, call_of_record: np.ndarray) -> np.ndarray:
    """Per call, the largest reduction_condition of its backward results with fewer elements than
    its incoming gradient (1 where it has none)."""
    condition = np.ones(len(calls))
    backward = records["direction"] == "backward"
    incoming = np.flatnonzero(backward & (records["role"] == "grad_output") & (records["arg_index"] == 0))
    results = np.flatnonzero(backward & (records["role"] == "grad_input"))
    if not len(incoming) or not len(results):
        return condition
    norm = records["norm_a"].astype(np.float64)
    numel = np.array([_numel(str(shape)) for shape in records["shape_a"].tolist()], np.float64)
    of_call = np.full(len(calls), -1, np.int64)
    of_call[call_of_record[incoming]] = incoming
    g = of_call[call_of_record[results]]
    summed = results[(g >= 0) & (numel[results] < numel[np.maximum(g, 0)])]
    g = of_call[call_of_record[summed]]
    summing = reduction_condition(norm[g], numel[g], norm[summed], numel[summed])
    np.maximum.at(condition, call_of_record[summed], summing)
    return condition


@functools.lru_cache(maxsize=4096)
def dimensions(shape: str) -> tuple[int, ...] | None:
    """A record's shape (its text, as `[2, 3]`) as a tuple; None when it is not one."""
    try:
        dims = json.loads(shape)
    except (json.JSONDecodeError, TypeError):
        return None
    return tuple(dims) if isinstance(dims, list) and all(isinstance(d, int) for d in dims) else None


def _numel(shape: str) -> int:
    dims = dimensions(shape)
    return 0 if dims is None else int(np.prod(dims))


def _last_dimension(shape: str) -> int:
    dims = dimensions(shape)
    return dims[-1] if dims else 0


def introduced(output_error: np.ndarray, input_error: np.ndarray, condition: np.ndarray,
               floor: np.ndarray) -> np.ndarray:
    """e_out / max(C × e_in, floor): how many times more error leaves the call than its inputs and
    rounding explain."""
    with np.errstate(over="ignore", invalid="ignore"):
        explained = np.maximum(condition * input_error, np.where(floor > 0, floor, np.finfo(float).tiny))
        return np.where(np.isnan(output_error), np.nan, output_error / explained)
