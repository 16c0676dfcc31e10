"""The first stage of the verdict: each row against its limits (its dtype's, raised by a noise
reference): pass, warn, fail, or n/a."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pi0align.compare.judging.reference import raised_limits
from pi0align.compare.judging.thresholds import JUDGED_ERRORS
from pi0align.compare.measuring.metrics import relative
from pi0align.compare.result import COMPARABLE, SAME_SHAPE_AND_DTYPE
from pi0align.compare.table import Table

JUDGED = (*JUDGED_ERRORS, "cosine")  # cosine is judged as 1 - cosine against 1 - its limit


def metric_errors(rows: Table) -> dict[str, np.ndarray]:
    """Each judged error per row (for cosine: 1 - cosine); NaN where not measured."""
    errors = {m: rows[m].astype(np.float64) for m in JUDGED_ERRORS}
    errors["cosine"] = 1.0 - rows["cosine"].astype(np.float64)
    return errors


def metric_limits(rows: Table, thresholds: dict) -> dict[str, np.ndarray]:
    """Each judged error's limit per row (cosine: 1 - limit), NaN where the pair is not judged.
    A pair of two dtypes is judged by the looser one's thresholds."""
    judged = rows.isin("pairing", *COMPARABLE)
    classes = np.where(judged, rows["dtype_class"], "")
    limits = {m: np.full(len(rows), np.nan) for m in JUDGED}
    for cls in set(classes[judged]):
        mask = classes == cls
        for m in JUDGED_ERRORS:
            limits[m][mask] = thresholds[cls][m]
        limits["cosine"][mask] = 1.0 - thresholds[cls]["cosine"]
    return limits


def metric_ratios(errors: dict[str, np.ndarray], limits: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each judged error over its limit per row; NaN where not measured or not judged."""
    return {m: np.where(np.isnan(limits[m]), np.nan, relative(errors[m], np.nan_to_num(limits[m]))) for m in JUDGED}


def severity(ratios: dict[str, np.ndarray]) -> np.ndarray:
    """Largest judged error over its limit per row (> 1 fails); NaN when nothing was judged."""
    stacked = np.vstack(list(ratios.values()))
    with np.errstate(invalid="ignore"):
        any_value = ~np.isnan(stacked).all(axis=0)
        return np.where(any_value, np.nanmax(np.where(np.isnan(stacked), -np.inf, stacked), axis=0), np.nan)


def verdicts(rows: Table, severities: np.ndarray, thresholds: dict) -> np.ndarray:
    warn_fraction = {cls: limits["warn_fraction"] for cls, limits in thresholds.items()}
    classes = rows["dtype_class"]
    warn_at = np.array([warn_fraction.get(cls, np.nan) for cls in classes.tolist()], dtype=np.float64)
    with np.errstate(invalid="ignore"):
        return np.where(np.isnan(severities), "n/a",
                        np.where(severities > 1, "fail", np.where(severities > warn_at, "warn", "pass")))


@dataclass(frozen=True)
class RowVerdicts:
    """Per row: its verdict against its limits, the largest error over its limit, whether it
    exceeds the fixed dtype limits, and whether both sides hold the same bits."""

    verdict: np.ndarray
    severity: np.ndarray
    over_dtype_limits: np.ndarray
    identical: np.ndarray


def judge_rows(rows: Table, thresholds: dict, reference: Table | None = None) -> RowVerdicts:
    """Every row against its dtype's limits, raised to a noise reference's where one is given
    (reference.py); a data record whose bits differ fails whatever its statistics say."""
    errors, limits = metric_errors(rows), metric_limits(rows, thresholds)
    over_dtype_limits = severity(metric_ratios(errors, limits)) > 1
    if reference is not None:
        limits = raised_limits(rows, limits, reference, metric_errors(reference))
    row_severity = severity(metric_ratios(errors, limits))
    verdict = verdicts(rows, row_severity, thresholds).astype(object)
    identical = identical_values(rows)
    verdict[data_differ(rows, identical)] = "fail"
    return RowVerdicts(verdict=verdict, severity=row_severity, over_dtype_limits=over_dtype_limits,
                       identical=identical)


def identical_values(rows: Table) -> np.ndarray:
    """Rows whose two records hold the same bits (equal checksums, both known)."""
    same = rows["checksum_a"].astype(np.int64) == rows["checksum_b"].astype(np.int64)
    return same & checksums_known(rows) & rows.isin("pairing", *SAME_SHAPE_AND_DTYPE)


def checksums_known(rows: Table) -> np.ndarray:
    """Rows whose two records both carry a checksum (-1: none, as msprobe's statistics)."""
    return (rows["checksum_a"] != -1) & (rows["checksum_b"] != -1)


def data_differ(rows: Table, identical: np.ndarray) -> np.ndarray:
    """Data records (the batch) of one dtype whose bits differ: the batch is read, not computed, so
    it holds no rounding noise, and one changed sample in sixteen moves its statistics less than
    bf16's limits."""
    known = checksums_known(rows) & (rows["dtype_a"] == rows["dtype_b"])
    return rows.isin("direction", "data") & known & ~identical & rows.isin("pairing", *SAME_SHAPE_AND_DTYPE)
