"""The call table: per call, the error into it, out of it, and introduced by it (out over what
its inputs and rounding explain, bounds.py).

Error propagates, so once one call diverges every later call does too: a call introduces error
when more error leaves it than its inputs, through its condition, and its own rounding explain.

Not every call is an API's: each has a kind (execution.kinds). A parameter's record at a step is a
call whose input is the optimizer's update of it at the step before (sources.py); the data are
calls without inputs; a parameter's gradient is a call whose inputs are the gradients its readers'
backward calls sent it; a module's parameters are inputs of its calls, so a module is never blamed
for the weights it was handed; what no dumped call computed is held apart (undumped.py).
"""

from __future__ import annotations

import numpy as np

from pi0align.compare.judging.calltable.bounds import (
    CallRecords,
    conditions,
    extremes_conditions,
    invariant_errors,
    numels,
    result_conditions,
    rounding_floor,
    step_bounds,
)
from pi0align.compare.judging.calltable.channels import (
    at_least,
    introduced_by_channel,
    precision_floors,
    row_error,
    statistic_channels,
)
from pi0align.compare.judging.calltable.sources import (
    add_gradient_sources,
    add_module_parameters,
    add_parameter_sources,
)
from pi0align.compare.judging.calltable.undumped import add_inside_errors, batch_stand_ins, model_input_rows
from pi0align.compare.judging.execution import PHASES, call_directions, kinds
from pi0align.compare.judging.identity import RESULT_ROLES, produced
from pi0align.compare.judging.modules import enclosing_modules
from pi0align.compare.judging.thresholds import class_roundoffs, unit_roundoffs
from pi0align.compare.reading.records import INPUT_ROLES, OUTPUT_ROLES
from pi0align.compare.result import CallRef
from pi0align.compare.table import Groups, Table, mapped

CALL_COLUMNS = ["rank", "step", "direction", "kind", "seq_a", "name", "module", "api", "input_error", "output_error",
                "inputs_pass", "outputs_fail", "introduced_error", "condition", "condition_rule", "invariant_error",
                "bound_condition", "unit", "floor", "metric",
                "local_error_a", "local_error_b", "unit_a", "unit_b", "replay", "args_differ", "inputs_identical",
                "outputs_differ", "inside_error", "inside_bound", "with_calls_inside", "sourced", "previous_step",
                "step_bound", "parameter_error"]


def judged_records(verdict: np.ndarray, rows: Table) -> np.ndarray:
    """Records that take part in the call table: judged, of a phase of the step."""
    of_a_phase = mapped(rows.coded("direction"), lambda direction: direction in PHASES, bool)
    return (verdict != "n/a") & (of_a_phase | rows.isin("role", "parameter_grad"))  # call_directions in PHASES


def producers(rows: Table, judged: np.ndarray, identity: np.ndarray) -> np.ndarray:
    """Per record, the judged record (`judged`: judged_records) that produced its tensor (a call's
    result, a parameter, the batch: identity.produced), -1 where none did."""
    return produced(rows, identity, rows.isin("role", *RESULT_ROLES) & judged)


def call_table(rows: Table, verdict: np.ndarray, judged: np.ndarray, rounding: np.ndarray, identity: np.ndarray,
               producer: np.ndarray, first_step: int | None = None, parameters_before: Table | None = None,
               noisy_start: bool = False) -> Table:
    """One row per judged call (CALL_COLUMNS), in order of step, seq_a and rank. `verdict`: each
    record's verdict against its limits; `judged`: the records the table is made of
    (`judged_records`); `rounding`: records whose difference is rounding-level noise (noise.py),
    which fail no call; `identity`: each record's tensor (identity.py);
    `producer`: the record that produced each record's tensor (`producers`). Where steps before
    these rows' were judged apart: `first_step`, the first step of the comparison (else these
    rows' first); `parameters_before`, the latest calls of each parameter, its gradient and its
    update among them (`parameter_calls`). `noisy_start`: the runs started from the same weights and
    compute differently (their manifests), so a parameter first dumped past step 0 may have parted by
    rounding: it stands for the updates before."""
    failing_rows = (verdict == "fail") & ~rounding
    channels = _row_channels(rows, rounding)
    use = np.flatnonzero(judged)
    judged = rows.taken_when_read(use)  # about 20 of the rows' 50 columns are read
    groups = Groups(judged["rank"], judged["step"], call_directions(judged), judged["seq_a"].astype(np.int64))
    calls, results, of = _grouped_calls(judged, groups, channels, use, rounding[use], failing_rows[use])
    if first_step is None:
        first_step = int(rows["step"].min()) if len(rows) else 0
    add_module_parameters(calls, judged, channels["error"][use], failing_rows[use])
    add_parameter_sources(calls, parameters_before, noisy_start)
    calls["step_bound"], calls["parameter_error"] = step_bounds(of, channels["error"][use])
    _add_saved_tensors(calls, of.forward_call)
    add_gradient_sources(calls, rows, identity, channels["source"], failing_rows)
    call_of_row = np.full(len(rows), -1, np.int64)
    call_of_row[use] = groups.codes
    parent = enclosing_modules(calls)
    model_inputs = model_input_rows(calls, rows, call_of_row, producer, parent, identity)
    # the batch entered no module from an undumped call: it is data, not the module's
    add_inside_errors(calls, rows, call_of_row, producer, parent, identity, channels, failing_rows & ~model_inputs)
    stand_ins = batch_stand_ins(calls, rows, call_of_row, model_inputs, channels["error"], failing_rows,
                                channels["metric"])
    results = Table.concat([results, _stand_in_results(stand_ins, len(calls))])
    return _introduced(Table.concat([calls, stand_ins]), results, first_step)


def _row_channels(rows: Table, rounding: np.ndarray) -> Table:
    """Per row: its error and metric (row_error), its errors as a source of error in a bound
    (`source`, `summed_source`: elementwise_errors) and its statistic_channels (`summed`,
    `extremes`, `spread`). Rounding noise (`rounding`) no call made: it neither enters nor leaves a
    call (its error and sources NaN)."""
    error, metric = row_error(rows)
    summed, extremes, spread = statistic_channels(rows)
    floors = precision_floors(rows)
    source = np.where(rounding, np.nan, at_least(error, floors))
    summed_source = np.where(rounding, np.nan, at_least(summed, floors))
    error[rounding] = np.nan
    return Table({"error": error, "metric": metric, "source": source, "summed_source": summed_source,
                  "summed": summed, "extremes": extremes, "spread": spread}, length=len(rows))


def _grouped_calls(judged: Table, groups: Groups, channels: Table, use: np.ndarray, rounding: np.ndarray,
                   fail: np.ndarray) -> tuple[Table, Table, CallRecords]:
    """The calls of the judged records (`groups`: one per call; `use`: their rows in `channels`),
    with their conditions, and their results: each judged output's call (`call`), its statistic
    channels, elements and own conditions (bounds.result_conditions); and the calls' records, as
    the bounds read them."""
    sources, error, metric = (channels[c][use] for c in ("source", "error", "metric"))
    summed, extremes, spread, summed_sources = (np.nan_to_num(np.where(rounding, np.nan, channels[c][use]))
                                                for c in ("summed", "extremes", "spread", "summed_source"))
    is_in = judged.isin("role", *INPUT_ROLES)
    is_out = judged.isin("role", *OUTPUT_ROLES, "parameter", "parameter_grad")
    roundoff = class_roundoffs(judged.coded("dtype_class"))
    first = groups.first
    identical = judged["identical"].astype(bool)
    calls = Table({
        "rank": judged["rank"][first], "step": judged["step"][first],
        "direction": call_directions(judged).take(first), "seq_a": judged["seq_a"].astype(np.int64)[first],
        "name": judged["name"][first], "module": judged.coded("module").take(first),
        "api": judged.coded("api").take(first),
        "input_error": groups.max(np.where(is_in & ~np.isnan(sources), sources, 0.0)),
        "output_error": groups.max(np.where(is_out, np.where(np.isnan(error), 0.0, error), -np.inf)),
        # the output's error by channel (statistic_channels), the inputs' summed errors (each
        # floored, as `sources`), and the spread its inputs and outputs may carry in their elements
        "output_summed": groups.max(np.where(is_out, summed, 0.0)),
        "input_spread": groups.max(np.where(is_in, spread, 0.0)),
        "input_summed": groups.max(np.where(is_in, summed_sources, 0.0)),
        "output_spread": groups.max(np.where(is_out, spread, 0.0)),
        "inputs_fail": groups.any(is_in & fail), "outputs_fail": groups.any(is_out & fail),
        "unit": groups.max(np.where(is_out, roundoff, 0.0)),
        "metric": groups.max_text(np.where(is_out, metric, "").astype(object)),
        # replay (replayed.py): each side's largest local error over the call's results, the unit
        # roundoff of its result dtypes, and why it was not replayed
        "local_error_a": groups.max(np.where(is_out, judged["local_error_a"].astype(np.float64), np.nan)),
        "local_error_b": groups.max(np.where(is_out, judged["local_error_b"].astype(np.float64), np.nan)),
        "unit_a": groups.max(np.where(is_out, unit_roundoffs(judged.coded("dtype_a")), 0.0)),
        "unit_b": groups.max(np.where(is_out, unit_roundoffs(judged.coded("dtype_b")), 0.0)),
        "replay": groups.max_text(np.where(is_out, judged["replay"], "").astype(object)),
        "args_differ": groups.any(judged["args_differ"].astype(bool)),
        # exact evidence: every input holds the same bits on both sides, some output does not
        "inputs_identical": ~groups.any(is_in & ~identical),
        "outputs_differ": groups.any(is_out & ~identical),
    })
    of = CallRecords(calls, judged, groups.codes)
    calls["condition"], calls["condition_rule"] = conditions(of)
    calls["condition_extremes"] = extremes_conditions(of)
    out = np.flatnonzero(is_out)
    condition, condition_extremes = (c[out] for c in result_conditions(of))
    results = Table({"call": groups.codes[out], "summed": summed[out], "extremes": extremes[out],
                     "numel": numels(judged["shape_a"][out]), "condition": condition,
                     "condition_extremes": condition_extremes})
    calls["invariant_error"] = invariant_errors(of)
    calls["sourced"] = np.ones(len(calls), bool)  # False: what made its input is not known
    calls["previous_step"] = np.full(len(calls), -1, np.int64)
    calls["from_start"] = np.zeros(len(calls), bool)  # read by step_bounds, not kept
    return calls, results, of


def _introduced(calls: Table, results: Table, first_step: int) -> Table:
    """The call table's last columns: each call's kind, rounding floor and introduced error (by
    channel over its `results`, or what the module computed that no dumped call did), the calls
    with no judged output left out (they introduce nothing), in order of step, seq_a and rank."""
    calls["group"] = np.arange(len(calls))  # what `results` refer to
    calls = calls.take(calls["output_error"] > -np.inf)
    calls["kind"] = kinds(calls, first_step)
    calls["inputs_pass"] = ~calls["inputs_fail"]
    calls["floor"] = rounding_floor(calls["unit"], calls["condition"], calls["condition_rule"], calls.coded("api"))
    by_channel, calls["bound_condition"] = introduced_by_channel(calls, results)
    with np.errstate(divide="ignore", invalid="ignore"):
        calls["introduced_error"] = np.fmax(np.where(calls["with_calls_inside"], calls["inside_introduced"],
                                                     by_channel), calls["invariant_error"] / calls["floor"])
    return calls.select(CALL_COLUMNS).take(np.lexsort((calls["rank"], calls["seq_a"], calls["step"])))


def _stand_in_results(stand_ins: Table, first: int) -> Table:
    """The results of the batch's stand-ins (numbered from `first` in the call table): their whole
    error, summed, and nothing their inputs explain."""
    n = len(stand_ins)
    return Table({"call": np.arange(first, first + n), "summed": stand_ins["output_summed"].astype(np.float64),
                  "extremes": np.zeros(n), "numel": np.ones(n), "condition": np.full(n, np.nan),
                  "condition_extremes": np.full(n, np.nan)})


def _add_saved_tensors(calls: Table, saved: np.ndarray) -> None:
    """A backward call also reads what its forward call saved (its inputs and outputs; `saved`: each
    call's forward call, CallRecords.forward_call): count the forward call's error as input error of
    the backward call of the same name."""
    backward = calls.isin("direction", "backward") & (saved >= 0)
    source = saved[backward]
    saved_error = np.maximum(calls["input_error"][source], calls["output_error"][source])
    calls["input_error"][backward] = np.fmax(calls["input_error"][backward], saved_error)
    for column, output in (("input_spread", "output_spread"), ("input_summed", "output_summed")):
        saved = np.maximum(calls[column][source], calls[output][source])
        calls[column][backward] = np.fmax(calls[column][backward], saved)
    calls["inputs_fail"][backward] |= calls["inputs_fail"][source] | calls["outputs_fail"][source]
    calls["inputs_identical"][backward] &= calls["inputs_identical"][source] & ~calls["outputs_differ"][source]


def call_ref(calls: Table, i: int, stack_of, cls=CallRef, **extra):
    """Call i of the table as the user needs to find it (a CallRef, or `cls` with `extra`)."""
    rank, step, seq = int(calls["rank"][i]), int(calls["step"][i]), int(calls["seq_a"][i])
    return cls(step=step, name=str(calls["name"][i]), module=str(calls["module"][i]), api=str(calls["api"][i]),
               direction=str(calls["direction"][i]), stack=stack_of(rank, step, seq), rank=rank,
               kind=str(calls["kind"][i]), **extra)
