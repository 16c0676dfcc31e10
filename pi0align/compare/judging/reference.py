"""A noise reference: A's run again with every result moved by an ulp (`pi0align run
--perturb-ulps 1`). Compared against A like B, it tells how far this model carries rounding to
each record, and each record's limits are raised to that (docs/compare.md, "Noise models")."""

from __future__ import annotations

import numpy as np

from pi0align.compare.judging.noise import rounding_share
from pi0align.compare.judging.thresholds import looser_classes
from pi0align.compare.reading.records import Dump
from pi0align.compare.table import Groups, Table, gather, lookup
from pi0align.errors import UserError

# A record may be this many times as far from A as the noise reference is: the reference moves
# each result by up to one ulp at random, a device's rounding by up to half an ulp each side, so
# the run under test may differ by about twice the reference's spread, and MARGIN doubles that for
# the spread of a maximum over one draw (docs/compare.md, "Noise models").
REFERENCE_MARGIN = 4.0
# calls on either side whose reference errors bound a call's: one record's own reference error may
# be zero by chance, and error grows smoothly through a network
REFERENCE_WINDOW = 4


def raised_limits(rows: Table, limits: dict, reference: Table, reference_errors: dict[str, np.ndarray]) -> dict:
    """Each row's limits raised to the noise reference, metric by metric: to MARGIN × that metric's
    envelope, the largest error the reference (A against REF) shows on the records of the calls of
    A within WINDOW calls of the row's call, in execution order. Records whose norm is at rounding
    level beside the largest record of their call (noise.rounding_share) take no part: their
    relative error is about 1 by rounding alone, and would lift the limits of a window of calls to
    MARGIN × 100 %. Never stricter than the dtype limits; rows of calls the reference lacks keep them."""
    keys = ("rank", "step", "direction")
    known = ~np.isnan(reference["seq_a"].astype(np.float64))
    calls = Groups(*(reference[k][known] for k in keys), reference["seq_a"][known])
    norm = np.nan_to_num(reference["norm_a"].astype(np.float64)[known], nan=0.0)
    largest = calls.max(norm)[calls.codes]
    classes = looser_classes(reference["dtype_a"][known], reference["dtype_b"][known])
    significant = norm >= rounding_share(classes) * largest
    first = np.flatnonzero(known)[calls.first]
    call_keys = [*(reference[k][first] for k in keys), reference["seq_a"][first].astype(np.float64)]
    order = np.lexsort(call_keys[::-1])  # calls in execution order within (rank, step, direction)
    stretch = Groups(*(key[order] for key in call_keys[:3])).codes  # which stretch each call is in
    call = lookup([*(rows[k] for k in keys), rows["seq_a"].astype(np.float64)], call_keys)
    raised = {}
    for metric, errors in reference_errors.items():
        per_call = calls.max(np.where(significant, np.nan_to_num(errors[known], nan=0.0, posinf=0.0), 0.0))[order]
        envelope = per_call.copy()
        for shift in range(1, REFERENCE_WINDOW + 1):
            same = stretch[shift:] == stretch[:-shift]
            envelope[shift:] = np.where(same, np.maximum(envelope[shift:], per_call[:-shift]), envelope[shift:])
            envelope[:-shift] = np.where(same, np.maximum(envelope[:-shift], per_call[shift:]), envelope[:-shift])
        by_call = np.empty_like(envelope)
        by_call[order] = envelope
        raised[metric] = np.fmax(limits[metric], REFERENCE_MARGIN * gather(by_call, call, 0.0))
        raised[metric][np.isnan(limits[metric])] = np.nan
    return raised


def check_reference(runs_a: dict[int, Dump], runs_reference: dict[int, Dump], path_a, path_reference) -> None:
    """A noise reference is A's run again: the same seed, dtype and initial weights."""
    a, reference = runs_a[min(runs_a)].manifest, runs_reference[min(runs_reference)].manifest
    for key in ("weights_sha256", "seed", "dtype"):
        if a.get(key) is not None and reference.get(key) is not None and a[key] != reference[key]:
            raise UserError(f"{path_reference} is not a noise reference of {path_a}: its {key} differs "
                            "(make it by running A's configuration again with --perturb-ulps 1)")


def reference_notes(runs: dict[int, Dump]) -> list[str]:
    ulps = runs[min(runs)].manifest.get("perturb_ulps")
    if not ulps:
        return ["the noise reference was not made with --perturb-ulps: its differences from A are taken as noise"]
    return []
