"""Judge each row against the thresholds of its dtype: pass, warn, fail, or n/a."""

from __future__ import annotations

import numpy as np

from pi0align.compare.metrics import relative
from pi0align.compare.table import Table, isin
from pi0align.compare.thresholds import JUDGED_ERRORS, looser_classes

JUDGED_PAIRINGS = ("matched", "realigned", "dtype_mismatch")  # shape mismatches cannot be compared


JUDGED = (*JUDGED_ERRORS, "cosine")  # cosine is judged as 1 - cosine against 1 - its limit


def metric_errors(rows: Table) -> dict[str, np.ndarray]:
    """Each judged error per row (for cosine: 1 - cosine); NaN where not measured."""
    errors = {m: rows[m].astype(np.float64) for m in JUDGED_ERRORS}
    errors["cosine"] = 1.0 - rows["cosine"].astype(np.float64)
    return errors


def metric_limits(rows: Table, thresholds: dict) -> dict[str, np.ndarray]:
    """Each judged error's limit per row (cosine: 1 - limit), NaN where the pair is not judged.
    A pair of two dtypes is judged by the looser one's thresholds."""
    judged = isin(rows["pairing"], JUDGED_PAIRINGS)
    classes = np.where(judged, looser_classes(rows["dtype_a"], rows["dtype_b"]), "")
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
    classes = looser_classes(rows["dtype_a"], rows["dtype_b"])
    warn_at = np.array([warn_fraction.get(cls, np.nan) for cls in classes.tolist()], dtype=np.float64)
    with np.errstate(invalid="ignore"):
        return np.where(np.isnan(severities), "n/a",
                        np.where(severities > 1, "fail", np.where(severities > warn_at, "warn", "pass")))
