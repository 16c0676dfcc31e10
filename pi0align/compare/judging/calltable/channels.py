"""Error channels: the error of each record, as measured and as a source of error in a bound.

Full tensors are judged by their relative L2 error. Statistics give two channels: the summed ones
(norm, mean), which see a change of every element and damp random differences by √N, and the
extremes (min, max), single elements. Each call's result is held, channel by channel, to what its
inputs explain through its condition (`introduced_by_channel`; docs/compare.md, Bounds).
"""

from __future__ import annotations

import numpy as np

from pi0align.compare.judging.calltable.bounds import (
    half_precision,
    introduced,
    noise_floor,
    numels,
    rounding_floor,
)
from pi0align.compare.judging.thresholds import UNIT_ROUNDOFF
from pi0align.compare.judging.verdict import checksums_known
from pi0align.compare.table import Groups, Table, mapped

STATS_ERRORS = ["norm_rel_err", "mean_val_rel_err", "min_rel_err", "max_val_rel_err"]
# A norm and a mean sum a tensor's elementwise differences, so random ones (rounding's) move them
# about √N times less than the elements; the extremes are single elements, which move with them
# (docs/compare.md, "Bounds": two channels)
SUMMED_STATISTICS, EXTREME_STATISTICS = STATS_ERRORS[:2], STATS_ERRORS[2:]


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
    floor = rounding_floor(unit, condition, calls["condition_rule"][c], calls.coded("api").take(c))
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
    roundoff = mapped(rows.coded("dtype_class"), lambda c: UNIT_ROUNDOFF.get(c, np.inf), np.float64)
    floating = roundoff < UNIT_ROUNDOFF["integer"]  # no dtype (one side only): none
    step = Groups(rows["rank"], rows["step"])
    coarsest = step.max(np.where(floating, roundoff, 0.0))[step.codes]
    known = checksums_known(rows)
    with np.errstate(invalid="ignore"):
        differs = (known & ~rows["identical"].astype(bool)) | (rows["rel_l2_err"].astype(np.float64) > 0)
        for statistic in STATS_ERRORS:
            differs |= rows[statistic].astype(np.float64) > 0
    return np.where(differs & floating & (rows["evidence"] != "tensor"), noise_floor(coarsest), 0.0)


def at_least(error: np.ndarray, floors: np.ndarray) -> np.ndarray:
    """Each measured error raised to its floor; NaN (not measured) stays."""
    return np.where(np.isnan(error), error, np.maximum(error, floors))

