"""A window's judging, stage after stage: the rows against their limits (verdict.py), the call
table (calls.py), the judgement of each call (judge.py), and which failing rows the noise model
explains (explain.py). A function of typed inputs, the comparison's settings and what the windows
before carried, to a frozen result, which the Conclusion folds (conclusion.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pi0align.compare.judging.calltable.calls import call_table, judged_records, producers
from pi0align.compare.judging.calltable.sources import parameter_calls
from pi0align.compare.judging.explain import Explanation, explain, optimizer_states
from pi0align.compare.judging.identity import tensor_identities
from pi0align.compare.judging.judge import Judgement, Position, bit_comparable, computes_alike, first_positions, judge
from pi0align.compare.judging.noise import rounding_level
from pi0align.compare.judging.thresholds import looser_classes
from pi0align.compare.judging.verdict import judge_rows
from pi0align.compare.measuring.manifest import host_cpus_differ, same_initial_weights
from pi0align.compare.reading.records import OUTPUT_ROLES
from pi0align.compare.table import Table, gather, lookup


@dataclass(frozen=True)
class Settings:
    """What every window is judged by: the thresholds, the noise model to fall back on
    ("reference" or "intrinsic"), and the two runs' manifests and their differences
    (manifest.manifest_diff)."""

    thresholds: dict
    fallback: str
    manifest_a: dict
    manifest_b: dict
    diff: tuple


@dataclass(frozen=True)
class Carried:
    """What a window needs of the windows before it: the comparison's first step and whether the
    runs are bit-comparable (from the first window), the latest calls of each parameter (what the
    next step's parameters read), the optimizer's latest state outputs (what the next update reads,
    after a gap in the dumped steps too), and each rank's first culprit (everything after it may
    inherit its error)."""

    first_step: int | None = None
    exact: bool | None = None
    parameters: Table | None = None
    states: Table | None = None
    earlier: tuple[Position, ...] = ()


@dataclass(frozen=True)
class JudgedWindow:
    """A window judged: its rows with their final verdicts (and `severity`, `over_dtype_limits`,
    `explained_by`, `introduced_error`, `identical`), the call table and the judgement of each call,
    the rows at rounding level, each row's tensor (identity.py), the explanation, and what the next
    window needs (`carried`)."""

    rows: Table
    calls: Table
    judgement: Judgement
    rounding: np.ndarray
    identity: np.ndarray
    explanation: Explanation
    carried: Carried


@dataclass(frozen=True)
class _Stages:
    """A window's rows through the stages up to the judgement of each call."""

    verdict: np.ndarray
    rounding: np.ndarray
    identity: np.ndarray
    producer: np.ndarray
    calls: Table
    judgement: Judgement
    noisy_start: bool
    carried: Carried


def judge_window(rows: Table, reference: Table | None, settings: Settings, carried: Carried,
                 alongside: Sequence[Position] = ()) -> JudgedWindow:
    """Judge one window's measured `rows` (against the noise reference's rows, if any); in a step
    judged a group of ranks at a time, knowing the other groups' `first_culprits` (`alongside`)."""
    earlier = (*carried.earlier, *alongside)
    stages = _stages(rows, reference, settings, carried, earlier)
    calls, judgement = stages.calls, stages.judgement
    explanation = explain(rows, stages.verdict, stages.rounding, stages.identity, stages.producer, calls, judgement,
                          earlier, carried.states, stages.noisy_start)
    rows["verdict"], rows["explained_by"] = explanation.verdict, explanation.explained_by
    rows["introduced_error"] = _introduced_per_row(rows, calls)
    ranks_parted = {position[0] for position in carried.earlier}  # their first culprits came in earlier windows
    after = Carried(
        first_step=stages.carried.first_step, exact=stages.carried.exact,
        parameters=parameter_calls(calls, carried.parameters),
        states=optimizer_states(rows, rows["verdict"], stages.rounding, carried.states),
        earlier=(*carried.earlier, *(p for p in first_positions(calls, judgement.culprit) if p[0] not in ranks_parted)))
    return JudgedWindow(rows, calls, judgement, stages.rounding, stages.identity, explanation, after)


def first_culprits(rows: Table, reference: Table | None, settings: Settings,
                   carried: Carried) -> tuple[list[Position], Carried]:
    """The first culprit of each rank of a group of a step's ranks judged alone (the first pass over
    a step too large to judge whole, windows.Window), and `carried` with the first window's facts
    where this is it; nothing else is kept of them."""
    stages = _stages(rows, reference, settings, carried, carried.earlier)
    return first_positions(stages.calls, stages.judgement.culprit), stages.carried


def _stages(rows: Table, reference: Table | None, settings: Settings, carried: Carried,
            earlier: Sequence[Position]) -> _Stages:
    """The rows against their limits, the call table and the judgement of each call; the
    comparison's first step and whether the runs are bit-comparable from the first window."""
    rows["dtype_class"] = looser_classes(rows.coded("dtype_a"), rows.coded("dtype_b"))  # read by every stage
    judged_rows = judge_rows(rows, settings.thresholds, reference)
    rounding = rounding_level(rows, judged_rows.verdict)
    rows["identical"] = judged_rows.identical
    rows["severity"], rows["over_dtype_limits"] = judged_rows.severity, judged_rows.over_dtype_limits
    if carried.first_step is None:
        carried = Carried(int(rows["step"].min()), bit_comparable(rows, judged_rows.identical, list(settings.diff),
                                                                  settings.manifest_a),
                          carried.parameters, carried.states, carried.earlier)
    identity = tensor_identities(rows)
    judged = judged_records(judged_rows.verdict, rows)
    producer = producers(rows, judged, identity)
    diff = list(settings.diff)
    # the same initial weights, which rounding alone may have parted by a first dumped step past 0
    # (or from one seed's weights, drawn by two hosts' CPUs: apart by rounding only)
    noisy_start = (same_initial_weights(diff, settings.manifest_a, settings.manifest_b) or host_cpus_differ(diff)) \
        and not computes_alike(diff, settings.manifest_a)
    calls = call_table(rows, judged_rows.verdict, judged, rounding, identity, producer, carried.first_step,
                       carried.parameters, noisy_start)
    judgement = judge(calls, settings.fallback, exact=carried.exact, earlier=earlier)
    return _Stages(judged_rows.verdict, rounding, identity, producer, calls, judgement, noisy_start, carried)


def _introduced_per_row(rows: Table, calls: Table) -> np.ndarray:
    """The call's introduced error on its output rows, NaN elsewhere."""
    keys = ("rank", "step", "direction")
    call = lookup([*(rows.coded(k) for k in keys), rows["seq_a"]],
                  [*(calls.coded(k) for k in keys), calls["seq_a"].astype(np.float64)])
    return np.where(rows.isin("role", *OUTPUT_ROLES), gather(calls["introduced_error"], call, np.nan), np.nan)
