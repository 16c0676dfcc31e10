"""The first divergence and the culprits, from the calls that judge.py finds guilty, in the order a
user should look at them, each with the bound it broke.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from pi0align.compare.judging.calltable.bounds import (
    SUMMING_RULES,
    explained_error,
    rounding_floor,
)
from pi0align.compare.judging.calltable.calls import call_ref
from pi0align.compare.judging.execution import execution_order, phases
from pi0align.compare.judging.judge import Judgement, replay_ratio_limit
from pi0align.compare.judging.thresholds import UNIT_ROUNDOFF
from pi0align.compare.result import CallRef, Culprit
from pi0align.compare.table import Table

# The culprits kept one by one (each with its stack and bound) for the reports. Past a hundred the
# runs differ everywhere alike (TF32 on every matmul, another dtype): the groups (groups.py) count
# every guilty call and name the pattern, and a hundred stacks keep the JSON and HTML readable.
MAX_CULPRITS = 100
CLEARLY_MORE = 10.0  # a later culprit ranks above an earlier one when its blame is this many times more


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
