"""The call table: per call, the error into it, out of it, and introduced by it (out over what
its inputs and rounding explain, bounds.py); the first divergence and the culprits, from the calls
that judge.py finds guilty.

Error propagates, so once one call diverges every later call does too: a call introduces error
when more error leaves it than its inputs, through its condition, and its own rounding explain.
Calls are searched in execution order: a step's parameters, its data, its forward calls, its
backward calls (in the order autograd ran them), the parameters' gradients, the API calls after
its backward (`update`: clipping and the optimizer's arithmetic, as msprobe records them), its
optimizer update.

Not every call is an API's: each has a kind (`kinds`). A parameter's record at a step is a call whose
input is the optimizer's update of it at the step before; where that update was not recorded (no
`optimizer=` given to the Dumper, or steps not dumped), the update is a call of its own, kind
`optimizer`, from the parameter and its gradient at the last dumped step before. At the first
dumped step a parameter has no input: its weights were given. The data are calls without inputs;
a parameter's gradient is a call (kind `gradient`) whose inputs are the gradients its readers'
backward calls sent it (autograd sums them); a module's parameters are inputs of its calls, so a
module is never blamed for the weights it was handed.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from pi0align.compare.judging.bounds import (
    SUMMING_RULES,
    conditions,
    dimensions,
    explained_error,
    extremes_conditions,
    forward_calls,
    half_precision,
    introduced,
    invariant_errors,
    noise_floor,
    numels,
    reduction_condition,
    result_conditions,
    rounding_floor,
    step_bounds,
)
from pi0align.compare.judging.identity import RESULT_ROLES, gradient_sources, produced, requires_grad
from pi0align.compare.judging.judge import Judgement, replay_ratio_limit
from pi0align.compare.judging.modules import enclosing_modules, enclosing_paths, holds_calls, is_module
from pi0align.compare.judging.thresholds import UNIT_ROUNDOFF, dtype_class, looser_classes
from pi0align.compare.reading.records import DIRECTIONS, INPUT_ROLES, OUTPUT_ROLES, function_names, subjects
from pi0align.compare.result import CallRef, Culprit
from pi0align.compare.table import Groups, Table, gather, isin, lookup
from pi0align.dump.file_format import RANDOM_FUNCTIONS

STATS_ERRORS = ["norm_rel_err", "mean_val_rel_err", "min_rel_err", "max_val_rel_err"]
# A norm and a mean sum a tensor's elementwise differences, so random ones (rounding's) move them
# about √N times less than the elements; the extremes are single elements, which move with them
# (docs/compare.md, "Bounds": two channels)
SUMMED_STATISTICS, EXTREME_STATISTICS = STATS_ERRORS[:2], STATS_ERRORS[2:]
MAX_CULPRITS = 100
CLEARLY_MORE = 10.0  # a later culprit ranks above an earlier one when its blame is this many times more
# kind of culprit by the direction of its call ("parameter": initial_weights or parameters)
# (a call inside the optimizer's step is the optimizer's update, though judged as any call: judge.py)
KIND_OF_DIRECTION = {"forward": "call", "backward": "call", "update": "call", "in_optimizer": "optimizer",
                     "optimizer": "optimizer", "data": "data", "gradient": "gradient"}
PHASES = DIRECTIONS  # a step's parts in execution order
CALL_COLUMNS = ["rank", "step", "direction", "kind", "seq_a", "name", "module", "api", "input_error", "output_error",
                "inputs_pass", "outputs_fail", "introduced_error", "condition", "condition_rule", "invariant_error",
                "bound_condition", "unit", "floor", "metric",
                "local_error_a", "local_error_b", "unit_a", "unit_b", "replay", "args_differ", "inputs_identical",
                "outputs_differ", "inside_error", "inside_bound", "with_calls_inside", "sourced", "previous_step",
                "step_bound", "parameter_error"]


def row_error(rows: Table) -> tuple[np.ndarray, np.ndarray]:
    """(error, metric name) per row: relative L2 error where values were compared, else the
    largest relative error of the statistics."""
    rel_l2 = rows["rel_l2_err"].astype(np.float64)
    use_values = ~np.isnan(rel_l2)
    return (np.where(use_values, rel_l2, _largest(rows, STATS_ERRORS)),
            np.where(use_values, "rel_l2_err", "stats_rel_err"))


def _largest(rows: Table, statistics: list[str]) -> np.ndarray:
    """Per row, the largest error of those statistics; NaN where none was measured."""
    values = np.column_stack([rows[s].astype(np.float64) for s in statistics])
    with np.errstate(invalid="ignore"):
        return np.where(np.isnan(values).all(axis=1), np.nan,
                        np.nanmax(np.where(np.isnan(values), -np.inf, values), axis=1))


def statistic_channels(rows: Table) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(summed, extremes, spread) per row. Where values were compared, summed is their relative L2
    error and the others NaN. Where statistics were: summed is the largest error of the norm and
    the mean, which see a change of every element (a fault's scale) and damp random differences
    by √N; extremes, the largest of the min's and max's, each an element's difference; spread,
    √N × summed, the elementwise relative L2 error that random differences of that summed error
    have (N the record's elements; a systematic change makes it larger, never smaller)."""
    tensors = ~np.isnan(rows["rel_l2_err"].astype(np.float64))
    summed = np.where(tensors, rows["rel_l2_err"].astype(np.float64), _largest(rows, SUMMED_STATISTICS))
    extremes = np.where(tensors, np.nan, _largest(rows, EXTREME_STATISTICS))
    spread = np.where(tensors, np.nan, np.sqrt(np.maximum(numels(rows["shape_a"]), 1.0)) * summed)
    return summed, extremes, spread


def call_directions(rows: Table) -> np.ndarray:
    """The direction of the call each record belongs to: a parameter's gradient is a call of its own."""
    return np.where(rows["role"] == "parameter_grad", "gradient", rows["direction"]).astype(object)


def judged_records(verdict: np.ndarray, rows: Table) -> np.ndarray:
    """Records that take part in the call table: judged, of a phase of the step."""
    return isin(verdict, ["pass", "warn", "fail"]) & isin(call_directions(rows), PHASES)


def producers(rows: Table, verdict: np.ndarray, identity: np.ndarray) -> np.ndarray:
    """Per record, the judged record that produced its tensor (a call's result, a parameter, the
    batch: identity.produced), -1 where none did."""
    return produced(rows, identity, isin(rows["role"], RESULT_ROLES) & judged_records(verdict, rows))


def call_table(rows: Table, verdict: np.ndarray, rounding: np.ndarray, identity: np.ndarray,
               producer: np.ndarray, first_step: int | None = None, parameters_before: Table | None = None,
               noisy_start: bool = False) -> Table:
    """One row per judged call (CALL_COLUMNS), in order of step, seq_a and rank. `verdict`: each
    record's verdict against its limits; `rounding`: records whose difference is rounding-level
    noise (noise.py), which fail no call; `identity`: each record's tensor (identity.py);
    `producer`: the record that produced each record's tensor (`producers`). Where steps before
    these rows' were judged apart: `first_step`, the first step of the comparison (else these
    rows' first); `parameters_before`, the latest calls of each parameter, its gradient and its
    update among them (`parameter_calls`). `noisy_start`: the runs started from the same weights and
    compute differently (their manifests), so a parameter first dumped past step 0 may have parted by
    rounding: it stands for the updates before."""
    failing_rows = (verdict == "fail") & ~rounding
    error_rows, metric_rows = row_error(rows)
    summed_all, extremes_all, spread_all = statistic_channels(rows)
    floors = precision_floors(rows)
    # as sources of error in a bound (elementwise_errors); rounding noise enters no call
    sources = np.where(rounding, np.nan, at_least(error_rows, floors))
    summed_sources = np.where(rounding, np.nan, at_least(summed_all, floors))
    error_rows[rounding] = np.nan  # noise that no call made: it neither enters nor leaves a call
    use = np.flatnonzero(judged_records(verdict, rows))
    judged = rows.taken_when_read(use)  # about 20 of the rows' 50 columns are read
    error, metric, fail = error_rows[use], metric_rows[use], failing_rows[use]
    summed, extremes, spread, summed_sources_used = (np.nan_to_num(np.where(rounding[use], np.nan, channel[use]))
                                                     for channel in (summed_all, extremes_all, spread_all,
                                                                     summed_sources))
    direction = call_directions(judged)
    is_in = isin(judged["role"], INPUT_ROLES)
    is_out = isin(judged["role"], (*OUTPUT_ROLES, "parameter", "parameter_grad"))
    roundoff = np.array([UNIT_ROUNDOFF[c] for c in looser_classes(judged["dtype_a"], judged["dtype_b"]).tolist()])
    seq_a = judged["seq_a"].astype(np.int64)
    groups = Groups(judged["rank"], judged["step"], direction, seq_a)  # one group per call
    first = groups.first
    identical = judged["identical"].astype(bool)
    calls = Table({
        "rank": judged["rank"][first], "step": judged["step"][first], "direction": direction[first],
        "seq_a": seq_a[first], "name": judged["name"][first], "module": judged["module"][first],
        "api": judged["api"][first],
        "input_error": groups.max(np.where(is_in & ~np.isnan(sources[use]), sources[use], 0.0)),
        "output_error": groups.max(np.where(is_out, np.where(np.isnan(error), 0.0, error), -np.inf)),
        # the output's error by channel (statistic_channels), the inputs' summed errors (each
        # floored, as `sources`), and the spread its inputs and outputs may carry in their elements
        "output_summed": groups.max(np.where(is_out, summed, 0.0)),
        "input_spread": groups.max(np.where(is_in, spread, 0.0)),
        "input_summed": groups.max(np.where(is_in, summed_sources_used, 0.0)),
        "output_spread": groups.max(np.where(is_out, spread, 0.0)),
        "inputs_fail": groups.any(is_in & fail), "outputs_fail": groups.any(is_out & fail),
        "unit": groups.max(np.where(is_out, roundoff, 0.0)),
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
        "inputs_identical": ~groups.any(is_in & ~identical),
        "outputs_differ": groups.any(is_out & ~identical),
    })
    calls["condition"], calls["condition_rule"] = conditions(calls, judged, groups.codes)
    calls["condition_extremes"] = extremes_conditions(calls, judged, groups.codes)
    out = np.flatnonzero(is_out)
    condition, condition_extremes = (c[out] for c in result_conditions(calls, judged, groups.codes))
    results = Table({"call": groups.codes[out], "summed": summed[out], "extremes": extremes[out],
                     "numel": numels(judged["shape_a"][out]), "condition": condition,
                     "condition_extremes": condition_extremes})
    calls["invariant_error"] = invariant_errors(calls, judged, groups.codes)
    calls["sourced"] = np.ones(len(calls), bool)  # False: what made its input is not known
    calls["previous_step"] = np.full(len(calls), -1, np.int64)
    calls["from_start"] = np.zeros(len(calls), bool)  # read by step_bounds, not kept
    if first_step is None:
        first_step = int(rows["step"].min()) if len(rows) else 0
    _add_module_parameters(calls, judged, error, fail)
    _add_parameter_sources(calls, parameters_before, noisy_start)
    calls["step_bound"], calls["parameter_error"] = step_bounds(calls, judged, groups.codes, error)
    _add_saved_tensors(calls)
    _add_gradient_sources(calls, rows, identity, sources, failing_rows)
    call_of_row = np.full(len(rows), -1, np.int64)
    call_of_row[use] = groups.codes
    parent = enclosing_modules(calls)
    model_inputs = _model_inputs(calls, rows, call_of_row, producer, parent, identity)
    # the batch entered no module from an undumped call: it is data, not the module's
    channels = Table({"error": error_rows, "source": sources, "summed_source": summed_sources, "summed": summed_all,
                      "extremes": extremes_all, "spread": spread_all}, length=len(rows))
    _add_inside_errors(calls, rows, call_of_row, producer, parent, identity, channels, failing_rows & ~model_inputs)
    stand_ins = _batch_stand_ins(calls, rows, call_of_row, model_inputs, error_rows, failing_rows, metric_rows)
    results = Table.concat([results, _stand_in_results(stand_ins, len(calls))])
    calls = Table.concat([calls, stand_ins])
    calls["group"] = np.arange(len(calls))  # what `results` refer to
    calls = calls.take(calls["output_error"] > -np.inf)  # calls with no judged output introduce nothing
    calls["kind"] = kinds(calls, first_step)
    calls["inputs_pass"] = ~calls["inputs_fail"]
    calls["floor"] = rounding_floor(calls["unit"], calls["condition"], calls["condition_rule"], calls["api"])
    by_channel, calls["bound_condition"] = introduced_by_channel(calls, results)
    with np.errstate(divide="ignore", invalid="ignore"):
        calls["introduced_error"] = np.fmax(np.where(calls["with_calls_inside"], calls["inside_introduced"],
                                                     by_channel), calls["invariant_error"] / calls["floor"])
    return calls.select(CALL_COLUMNS).take(np.lexsort((calls["rank"], calls["seq_a"], calls["step"])))


def introduced_by_channel(calls: Table, results: Table) -> tuple[np.ndarray, np.ndarray]:
    """(introduced error, the condition that bound it) per call: the largest over its results
    (`results`: each judged output's call by `calls["group"]`, its statistic channels, elements and
    its own condition where bounds.result_conditions gives one, else the call's) of each channel's
    error over what the call's inputs explain through that result's condition. The summed ones
    against the inputs' errors, and in half precision also against what the noise of their
    elements explains (`_summed_against_noise`); the extremes against the spread the inputs may
    also carry (an extreme of bfloat16 ulp noise moved 2.7 % where the norms moved 0.1 % and the
    inputs' statistics 0.6 %: their elements were 2 % apart). In half precision only: in float32,
    rounding's spread is within the floor (16 u), and elements apart beyond it were made by
    something else (TF32 inputs, another kernel), which each call is held to as before. Full
    tensors are judged by their relative L2 error, whole. The extremes through their own condition
    where larger (bounds.extremes_conditions)."""
    position = np.full(max(calls["group"].max(initial=-1), results["call"].max(initial=-1)) + 1, -1, np.int64)
    position[calls["group"]] = np.arange(len(calls))
    c = position[results["call"]]
    results, c = results.take(c >= 0), c[c >= 0]
    own = ~np.isnan(results["condition"])
    condition = np.where(own, results["condition"], calls["condition"][c])
    extremes_condition = np.fmax(condition, np.where(own, results["condition_extremes"],
                                                     calls["condition_extremes"][c]))
    unit, input_error = calls["unit"][c], calls["input_error"][c]
    floor = rounding_floor(unit, condition, calls["condition_rule"][c], calls["api"][c])
    spread = np.where(half_precision(unit), calls["input_spread"][c], 0.0)
    ratio = channel_ratios(results["summed"], results["extremes"], results["numel"], input_error,
                           calls["input_summed"][c], spread, condition, extremes_condition, floor)
    ratio = np.where(np.isnan(ratio), -np.inf, ratio)  # an infinite one stays infinite
    largest, bound_condition = np.zeros(len(calls)), calls["condition"].astype(np.float64)
    order = np.lexsort((ratio, c))
    last = order[np.r_[c[order][1:] != c[order][:-1], True]] if len(order) else order  # each call's largest
    largest[c[last]], bound_condition[c[last]] = np.maximum(ratio[last], 0.0), condition[last]
    return largest, bound_condition


def channel_ratios(summed: np.ndarray, extremes: np.ndarray, numel: np.ndarray, input_error: np.ndarray,
                   input_summed: np.ndarray, spread: np.ndarray, condition: np.ndarray,
                   extremes_condition: np.ndarray, floor: np.ndarray) -> np.ndarray:
    """Per result, its error over what its inputs explain, the largest over its channels
    (statistic_channels): its summed error against the inputs' errors, its extremes against the
    larger of those and the spread the inputs carry (`spread`: 0 outside half precision), and its
    summed error against that spread summed away (`_summed_against_noise`)."""
    summed_ratio = introduced(summed, input_error, condition, floor)
    extremes_ratio = introduced(extremes, np.fmax(input_error, spread), extremes_condition, floor)
    against_noise = _summed_against_noise(summed, numel, spread, input_summed, condition, floor)
    return np.fmax(np.fmax(summed_ratio, extremes_ratio), against_noise)


# A norm's or a mean's move under random elementwise noise is a normal draw of about the
# elements' relative error / √N: beyond 3 of them in 0.3 % of results
NOISE_DRAWS = 3.0


def _summed_against_noise(summed: np.ndarray, numel: np.ndarray, spread: np.ndarray, input_summed: np.ndarray,
                          condition: np.ndarray, floor: np.ndarray) -> np.ndarray:
    """Per result, in half precision (`spread`: its call's inputs' spread there, 0 elsewhere), its
    summed error (statistic_channels) over what its call's inputs explain in it: C × the inputs'
    summed errors (a scale they carry, each floored as elementwise_errors), or NOISE_DRAWS × C ×
    the inputs' spread / √N of the result (the noise their elements carry, summed away), or its own
    rounding's floor. A fault that scales a result moves its norm alike at every N; noise moves it
    √N times less than its elements: a linear's gradient 5 % off in its norm, under noise that
    moved an extreme of its incoming gradient 3 % (its input error), was within 2 × 1.8 × 3 %
    (introduced_by_channel). 0 for results whose inputs carry no spread (statistics of inputs that
    agree, or full tensors)."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        noise = NOISE_DRAWS * condition * spread / np.sqrt(np.maximum(numel, 1.0))
        bound = np.maximum(np.maximum(condition * input_summed, noise), floor)
        return np.where(spread > 0, summed / bound, 0.0)


def _stand_in_results(stand_ins: Table, first: int) -> Table:
    """The results of the batch's stand-ins (numbered from `first` in the call table): their whole
    error, summed, and nothing their inputs explain."""
    n = len(stand_ins)
    return Table({"call": np.arange(first, first + n), "summed": stand_ins["output_summed"].astype(np.float64),
                  "extremes": np.zeros(n), "numel": np.ones(n), "condition": np.full(n, np.nan),
                  "condition_extremes": np.full(n, np.nan)})


def elementwise_errors(rows: Table) -> np.ndarray:
    """The error each record may carry in its elements, as a source of error in a bound (a call's
    input, a term of a gradient's sum): its measured error (row_error; NaN where not measured), at
    least its precision floor (`precision_floors`)."""
    return at_least(row_error(rows)[0], precision_floors(rows))


def precision_floors(rows: Table) -> np.ndarray:
    """Per record, the error it carries at least as a source (0 for most). Statistics and samples
    bound a tensor's elementwise error from below only: a floating record judged by them and known
    to differ (its bits, its samples, or one of its statistics) may differ in any element by the
    rounding of the precision its step computes in (the coarsest floating dtype of its step's
    records: float32 values computed from bfloat16 ones carry bfloat16's differences), so at least
    that noise floor. (A float32 gradient whose sampled elements agreed, of PI0 tiny in bf16 at 1
    and 2 threads, once counted as exact, and the sum of it over the batch was named.)"""
    classes = looser_classes(rows["dtype_a"], rows["dtype_b"]).tolist()
    roundoff = np.array([UNIT_ROUNDOFF.get(c, np.inf) for c in classes])
    floating = roundoff < UNIT_ROUNDOFF["integer"]  # no dtype (one side only): none
    step = Groups(rows["rank"], rows["step"])
    coarsest = step.max(np.where(floating, roundoff, 0.0))[step.codes]
    known = (rows["checksum_a"] != -1) & (rows["checksum_b"] != -1)
    with np.errstate(invalid="ignore"):
        differs = (known & ~rows["identical"].astype(bool)) | (rows["rel_l2_err"].astype(np.float64) > 0)
        for statistic in STATS_ERRORS:
            differs |= rows[statistic].astype(np.float64) > 0
    return np.where(differs & floating & (rows["evidence"] != "tensor"), noise_floor(coarsest), 0.0)


def at_least(error: np.ndarray, floors: np.ndarray) -> np.ndarray:
    """Each measured error raised to its floor; NaN (not measured) stays."""
    return np.where(np.isnan(error), error, np.maximum(error, floors))


def _units(dtypes: np.ndarray) -> np.ndarray:
    """Unit roundoff of each dtype name ("" = none: 0)."""
    table = {d: UNIT_ROUNDOFF[dtype_class(d)] if d else 0.0 for d in set(dtypes.tolist())}
    return np.array([table[d] for d in dtypes.tolist()], np.float64)


def kinds(calls: Table, first_step: int) -> np.ndarray:
    """Each call's kind: a parameter at step 0 holds the initial weights; later, or at a first
    dumped step past 0, the parameters (what training made of them); a parameter whose update
    was not recorded stands for that update (`optimizer`); a random draw (RANDOM_FUNCTIONS) is
    data: judged as any call (two hosts' kernels round its transform otherwise), one beyond that
    rounding was drawn from another generator state."""
    kind = np.array([KIND_OF_DIRECTION.get(d, "parameters") for d in calls["direction"].tolist()], dtype=object)
    kind[(kind == "call") & isin(function_names(calls["api"]), RANDOM_FUNCTIONS)] = "data"
    kind[(kind == "parameters") & (calls["step"] == 0) & (first_step == 0)] = "initial_weights"
    kind[(calls["direction"] == "parameter") & (calls["previous_step"] >= 0)] = "optimizer"
    return kind


def _add_module_parameters(calls: Table, judged: Table, error: np.ndarray, fail: np.ndarray) -> None:
    """A module call also reads its parameters and those of the modules below it, as the step's
    forward first read them (the parameter records): their error is the module call's input error."""
    params = np.flatnonzero(judged["role"] == "parameter")
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
    modules = np.flatnonzero(is_module(calls) & (calls["direction"] == "forward"))
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
    mine = calls.take(isin(calls["direction"], PARAMETER_DIRECTIONS))
    both = Table.concat([before.select(mine.columns), mine]) if before is not None else mine
    latest = np.lexsort((-both["step"], both["direction"], subjects(both["name"]), both["rank"]))
    both = both.take(latest)
    return both.take(Groups(both["rank"], subjects(both["name"]), both["direction"]).first)


# what a parameter's call reads of the calls before it (`_add_parameter_sources`)
_SOURCE_COLUMNS = ["rank", "step", "direction", "name", "output_error", "outputs_fail", "outputs_differ"]


def _add_parameter_sources(calls: Table, before: Table | None, noisy_start: bool) -> None:
    """A parameter's input is the optimizer's update of it at the step before. Where that update
    was not recorded, the parameter stands for it: its inputs are the parameter and its gradient
    at the last dumped step before (`previous_step`). At a parameter's first dumped step it has no
    input (the weights were given), unless that step is past 0 and the runs started from the same
    weights but compute differently (`noisy_start`): then it stands for the updates since step 0
    (`previous_step` 0 and `from_start`), whose gradients were not dumped; the gradient of its own
    step tells their error. `before`: calls of earlier steps (`parameter_calls`)."""
    own = len(calls)
    param = np.flatnonzero(calls["direction"] == "parameter")
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


def _add_gradient_sources(calls: Table, rows: Table, identity: np.ndarray, error: np.ndarray,
                          failing: np.ndarray) -> None:
    """A parameter's gradient is the sum of what its readers' backward calls sent it (identity.py);
    where none of them was dumped (a dump at level module), the module owning the parameter
    computed it: the input error of that module's backward call, or where that module was not
    dumped either (filtered out), of the innermost dumped module around it, which ran its code."""
    gradient = np.flatnonzero(calls["direction"] == "gradient")
    if not len(gradient):
        return
    bound, readers_fail = gradient_sources(rows, identity, error, failing)
    grad_rows = np.flatnonzero(rows["role"] == "parameter_grad")
    keys = ("rank", "step", "name")
    at = lookup([calls[k][gradient] for k in keys], [rows[k][grad_rows] for k in keys])
    row = np.where(at >= 0, grad_rows[np.maximum(at, 0)], -1)
    calls["input_error"][gradient] = gather(bound, row, np.nan)
    calls["inputs_fail"][gradient] = gather(readers_fail, row, False)
    calls["inputs_identical"][gradient] = False
    unknown = gradient[np.isnan(calls["input_error"][gradient])]
    if not len(unknown):
        return
    backward_modules = np.flatnonzero(is_module(calls) & (calls["direction"] == "backward"))
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
    saved = forward_calls(calls, np.arange(len(calls)))
    backward = (calls["direction"] == "backward") & (saved >= 0)
    source = saved[backward]
    saved_error = np.maximum(calls["input_error"][source], calls["output_error"][source])
    calls["input_error"][backward] = np.fmax(calls["input_error"][backward], saved_error)
    for column, output in (("input_spread", "output_spread"), ("input_summed", "output_summed")):
        saved = np.maximum(calls[column][source], calls[output][source])
        calls[column][backward] = np.fmax(calls[column][backward], saved)
    calls["inputs_fail"][backward] |= calls["inputs_fail"][source] | calls["outputs_fail"][source]
    calls["inputs_identical"][backward] &= calls["inputs_identical"][source] & ~calls["outputs_differ"][source]


def _add_inside_errors(calls: Table, rows: Table, call_of_row: np.ndarray, producer: np.ndarray,
                       parent: np.ndarray, identity: np.ndarray, channels: Table, failing: np.ndarray) -> None:
    """What a module holding calls computed that no dumped call did: the forward inputs of the
    calls inside it that no dumped call, parameter or batch produced (an operation filtered out,
    one of `torch.ops`, an extension kernel, calls on one side only, at level module the arithmetic
    between its children), and its output where no call inside it produced that. Each such result
    is held, channel by channel (`channel_ratios`), to what it could have read: the module's inputs
    and parameters and the outputs of its calls before it, through C = 1 (an API whose condition is
    not known), or its rounding. `inside_error`: the largest such result's error; the module's
    introduced error (`inside_introduced`, and the bound of its largest, `inside_bound`) the
    largest over them. Its calls are judged on their own. `call_of_row`: each row's call (-1:
    none); `producer`: the row that produced each row's tensor (identity.produced); `parent`:
    modules.enclosing_modules; `channels`: per row, its error, its errors as a source (`source`,
    `summed_source`: elementwise_errors) and statistic_channels (`summed`, `extremes`, `spread`)."""
    n = len(calls)
    for column in ("inside_error", "inside_introduced", "inside_bound"):
        calls[column] = np.zeros(n)
    calls["with_calls_inside"] = holds_calls(calls, parent)
    if not (parent >= 0).any():
        return
    in_table = call_of_row >= 0
    forward = rows["direction"] == "forward"
    seq = rows["seq_a"].astype(np.float64)

    def enclosing(call: int):
        module = parent[call]
        while module >= 0:
            yield module
            module = parent[module]

    outputs = np.flatnonzero(forward & (rows["role"] == "output") & in_table)
    made_inside: dict[int, set] = {}  # module call -> identities its calls' outputs hold
    read_inside: dict[int, list[int]] = {}  # module call -> its calls' output rows
    last_inside = np.full(n, np.nan)  # per module call, the sequence number of its last call
    for row in outputs.tolist():
        for module in enclosing(call_of_row[row]):
            made_inside.setdefault(module, set()).add(int(identity[row]))
            read_inside.setdefault(module, []).append(row)
            last_inside[module] = np.fmax(last_inside[module], seq[row])
    # when each output was made: a module's after its last call
    module_end = gather(last_inside, call_of_row, np.nan)
    made_at = np.where(np.isnan(module_end), seq, module_end + 0.5)
    undumped = [(module, row) for row in
                np.flatnonzero(forward & (rows["role"] == "input") & in_table & failing & (producer < 0)).tolist()
                for module in enclosing(call_of_row[row])]
    undumped += [(call_of_row[row], row) for row in outputs[failing[outputs]].tolist()
                 if calls["with_calls_inside"][call_of_row[row]]
                 and (identity[row] < 0 or int(identity[row]) not in made_inside.get(call_of_row[row], set()))]
    if not undumped:
        return
    module, row = (np.array(column, np.int64) for column in zip(*undumped))
    # what each could have read: the module's inputs, and its calls' outputs before it (its own
    # module's output: all of them), by the running largest of each channel in their order
    inputs = {"source": "input_error", "summed_source": "input_summed", "spread": "input_spread"}
    kinds = tuple(inputs)
    read = {kind: np.array(calls[column][module], np.float64) for kind, column in inputs.items()}
    running: dict[int, tuple] = {}
    for i, (m, r) in enumerate(zip(module.tolist(), row.tolist())):
        if m not in running:
            inner = np.array(read_inside.get(m, []), np.int64)
            inner = inner[np.argsort(made_at[inner], kind="stable")]
            running[m] = (made_at[inner], {kind: np.maximum.accumulate(np.nan_to_num(channels[kind][inner]))
                                       for kind in kinds})
        order, largest = running[m]
        before = len(order) if rows["role"][r] == "output" else int(np.searchsorted(order, seq[r]))
        if before:
            for kind in kinds:
                read[kind][i] = max(np.nan_to_num(read[kind][i]), largest[kind][before - 1])
    source, summed_source, spread = (read[kind] for kind in kinds)
    unit = calls["unit"][module].astype(np.float64)
    one = np.ones(len(row))
    floor = rounding_floor(unit, one, np.full(len(row), "", object), calls["api"][module])
    ratio = channel_ratios(channels["summed"][row], channels["extremes"][row], numels(rows["shape_a"][row]),
                           np.nan_to_num(source), np.nan_to_num(summed_source),
                           np.where(half_precision(unit), np.nan_to_num(spread), 0.0), one, one, floor)
    error = channels["error"][row]
    with np.errstate(divide="ignore", invalid="ignore"):
        bound = np.where(ratio > 0, error / ratio, floor)
    for i, m in enumerate(module.tolist()):
        calls["inside_error"][m] = max(calls["inside_error"][m], np.nan_to_num(error[i]))
        if np.nan_to_num(ratio[i], nan=-np.inf) > calls["inside_introduced"][m]:
            calls["inside_introduced"][m], calls["inside_bound"][m] = ratio[i], bound[i]


def _model_inputs(calls: Table, rows: Table, call_of_row: np.ndarray, producer: np.ndarray, parent: np.ndarray,
                  identity: np.ndarray) -> np.ndarray:
    """Where a step has no data records (msprobe's dumps; ours with the batch filtered out), the
    rows that stand for the batch: forward inputs that no dumped call, parameter or batch record
    produced, that require no gradient where the dump says (msprobe's do: weights and activations
    do), else read by calls that no module holds; of each such tensor, its first reader's row."""
    data = calls["direction"] == "data"
    grad = requires_grad(rows)
    read = (rows["direction"] == "forward") & (rows["role"] == "input") & (call_of_row >= 0) & (producer < 0)
    read &= np.where(grad >= 0, grad == 0, gather(parent, call_of_row, 0) < 0)
    read &= lookup([rows["rank"], rows["step"]], [calls["rank"][data], calls["step"][data]]) < 0
    first = np.zeros(len(rows), bool)
    candidates = np.flatnonzero(read)
    order = candidates[np.lexsort((rows["seq_a"][candidates].astype(np.float64), rows["step"][candidates],
                                   rows["rank"][candidates]))]
    seen: set[tuple[int, int, int]] = set()
    for row in order.tolist():
        tensor = (int(rows["rank"][row]), int(rows["step"][row]), int(identity[row]))
        if identity[row] < 0 or tensor not in seen:
            first[row] = True
            seen.add(tensor)
    return first


def _batch_stand_ins(calls: Table, rows: Table, call_of_row: np.ndarray, model_inputs: np.ndarray,
                     error: np.ndarray, failing: np.ndarray, metric: np.ndarray) -> Table:
    """One data call per failing row of the model's inputs (`_model_inputs`), named after the call
    that read it (`<call>/input <k>`), at that call's place."""
    rows_of = np.flatnonzero(model_inputs & failing).tolist()
    stand_ins = calls.take(call_of_row[rows_of])
    n = len(rows_of)
    stand_ins["direction"] = np.full(n, "data", object)
    stand_ins["api"] = np.full(n, "Data", object)
    stand_ins["name"] = np.array([f"{rows['name'][r]}/input {rows['arg_index'][r]}" for r in rows_of], object)
    stand_ins["output_error"], stand_ins["metric"] = error[rows_of], metric[rows_of]
    stand_ins["output_summed"] = error[rows_of]  # its whole error: nothing it was handed explains it
    for column, value in (("input_error", 0.0), ("input_summed", 0.0), ("input_spread", 0.0),
                          ("output_spread", 0.0), ("inputs_fail", False), ("outputs_fail", True),
                          ("inputs_identical", True), ("outputs_differ", True), ("args_differ", False),
                          ("inside_error", 0.0), ("inside_introduced", 0.0), ("inside_bound", 0.0),
                          ("with_calls_inside", False), ("condition", 1.0),
                          ("condition_rule", ""), ("condition_extremes", np.nan), ("invariant_error", 0.0),
                          ("local_error_a", np.nan), ("local_error_b", np.nan), ("replay", "")):
        stand_ins[column] = np.full(n, value, dtype=object if isinstance(value, str) else None)
    return stand_ins


def first_divergence(calls: Table, guilty: np.ndarray,
                     stack_of: Callable[[int, int, int], list[str]]) -> CallRef | None:
    """First call in execution order among `guilty`."""
    order = execution_order(calls)
    candidates = order[guilty[order]]
    if not len(candidates):
        return None
    return call_ref(calls, candidates[0], stack_of)


def culprit_order(calls: Table, judgement: Judgement) -> np.ndarray:
    """The culprits' rows of `calls`: earliest step first (later steps inherit an earlier step's
    error through the weights), then where the error starts, in execution order (the step's phase:
    forward before backward, as a faulty kernel's backward inherits its forward's fault; then
    sequence), except that a culprit whose blame is CLEARLY_MORE times an earlier one's or more
    ranks above it (blame counted in whole powers of CLEARLY_MORE, the largest first)."""
    guilty = np.flatnonzero(judgement.culprit)
    blame = np.nan_to_num(judgement.blame[guilty], nan=1.0, posinf=np.finfo(float).max)
    power = np.floor(np.log(np.maximum(blame, 1.0)) / np.log(CLEARLY_MORE))
    return guilty[np.lexsort((calls["seq_a"][guilty], phases(calls["direction"][guilty]), -power,
                              calls["step"][guilty]))]


def culprits(calls: Table, judgement: Judgement, stack_of: Callable[[int, int, int], list[str]]) -> list[Culprit]:
    """The guilty calls in `culprit_order`, each with the bound it broke."""
    guilty = culprit_order(calls, judgement)[:MAX_CULPRITS]
    number = lambda column, i: float(calls[column][i])
    return [call_ref(calls, i, stack_of, Culprit, introduced_error=number("introduced_error", i),
                 input_error=number("input_error", i), output_error=number("output_error", i),
                 metric=str(calls["metric"][i]), evidence=str(judgement.evidence[i]),
                 wrong_side=str(judgement.wrong_side[i]), local_error_a=number("local_error_a", i),
                 local_error_b=number("local_error_b", i), local_ratio=float(judgement.blame[i])
                 if judgement.evidence[i] == "replay" else float("nan"),
                 **dict(zip(("bound", "bound_by"), broken_bound(calls, i, judgement)))) for i in guilty]


_DTYPE_OF_UNIT = {unit: name for name, unit in UNIT_ROUNDOFF.items() if name != "integer"}


def broken_bound(calls: Table, i: int, judgement: Judgement) -> tuple[float, str]:
    """The bound culprit i broke, and what that bound is: the error its inputs (through its API's
    condition) and its rounding explain; under replay, the other side's local error; nothing where
    it was asked something else or, bit for bit, handed the same inputs."""
    evidence = judgement.evidence[i]
    if evidence == "arguments":
        return float("nan"), "its recorded arguments differ from the other side's"
    if evidence == "exact":
        return 0.0, "handed identical inputs (bit-comparable runs), its outputs differ"
    if evidence == "replay":
        wrong, other = ("b", "a") if judgement.wrong_side[i] == "B" else ("a", "b")
        unit = float(calls[f"unit_{wrong}"][i])
        floor = float(rounding_floor(unit, calls["condition"][i], calls["condition_rule"][i], calls["api"][i])[0])
        bound = float(replay_ratio_limit(unit) * calls[f"local_error_{other}"][i] + floor)
        return bound, (f"{replay_ratio_limit(unit):g} × the other side's local error + "
                       f"{floor / unit:.3g} u of {_DTYPE_OF_UNIT.get(unit, 'its dtype')}")
    unit, rule = float(calls["unit"][i]), str(calls["condition_rule"][i])
    if calls["with_calls_inside"][i]:
        return float(calls["inside_bound"][i]), ("what the module computed that was not dumped, within the errors "
                                                 "of its inputs and of its calls' outputs before it, and its rounding")
    condition = float(calls["bound_condition"][i])  # of the result that broke it
    floor = float(rounding_floor(unit, condition, rule, calls["api"][i])[0])
    if condition != float(calls["condition"][i]):
        rule = "its result's own"  # bounds.result_conditions
    invariant = float(calls["invariant_error"][i])
    bound = float(explained_error(calls["input_error"][i:i + 1], np.array([condition]), np.array([floor]))[0])
    rounding = f"{floor / unit:.3g} u of {_DTYPE_OF_UNIT.get(unit, 'its dtype')}" if unit else "rounding"
    if invariant and invariant / floor >= float(calls["introduced_error"][i]):
        return floor, f"rounding alone ({rounding}): the statistic its {rule} result keeps whatever its inputs"
    if bound > floor:
        return bound, f"its inputs' error × {condition:.3g}" + (f" ({rule}: docs/compare.md, Bounds)" if rule else "")
    summed = f", × {condition:.3g} for a sum whose terms cancel" if rule in SUMMING_RULES and condition > 1 else ""
    return floor, f"rounding ({rounding}{summed})"


def call_ref(calls: Table, i: int, stack_of, cls=CallRef, **extra):
    """Call i of the table as the user needs to find it (a CallRef, or `cls` with `extra`)."""
    rank, step, seq = int(calls["rank"][i]), int(calls["step"][i]), int(calls["seq_a"][i])
    return cls(step=step, name=str(calls["name"][i]), module=str(calls["module"][i]), api=str(calls["api"][i]),
               direction=str(calls["direction"][i]), stack=stack_of(rank, step, seq), rank=rank,
               kind=str(calls["kind"][i]), **extra)
