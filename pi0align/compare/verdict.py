"""Judge each row against the thresholds of its dtype: pass, warn, fail, or n/a."""

from __future__ import annotations

import numpy as np

from pi0align.compare.metrics import relative
from pi0align.compare.table import Table, isin
from pi0align.compare.thresholds import JUDGED_ERRORS, looser_classes

JUDGED_PAIRINGS = ("matched", "realigned", "dtype_mismatch")  # shape mismatches cannot be compared


def severity(rows: Table, thresholds: dict) -> np.ndarray:
    """Largest judged error over its limit per row (> 1 fails); NaN when nothing was judged.
    A pair of two dtypes is judged by the looser one's thresholds."""
    result = np.full(len(rows), np.nan)
    judged = isin(rows["pairing"], JUDGED_PAIRINGS)
    classes = np.where(judged, looser_classes(rows["dtype_a"], rows["dtype_b"]), "")
    for cls in set(classes[judged]):
        mask = classes == cls
        limits = thresholds[cls]
        ratios = [relative(rows[m][mask].astype(np.float64), np.full(mask.sum(), limits[m]))
                  for m in JUDGED_ERRORS]
        ratios.append(relative(1.0 - rows["cosine"][mask].astype(np.float64),
                               np.full(mask.sum(), 1.0 - limits["cosine"])))
        stacked = np.vstack(ratios)
        with np.errstate(invalid="ignore"):
            any_value = ~np.isnan(stacked).all(axis=0)
            result[mask] = np.where(any_value, np.nanmax(np.where(np.isnan(stacked), -np.inf, stacked), axis=0),
                                    np.nan)
    return result


def verdicts(rows: Table, severities: np.ndarray, thresholds: dict) -> np.ndarray:
    warn_fraction = {cls: limits["warn_fraction"] for cls, limits in thresholds.items()}
    classes = looser_classes(rows["dtype_a"], rows["dtype_b"])
    warn_at = np.array([warn_fraction.get(cls, np.nan) for cls in classes.tolist()], dtype=np.float64)
    with np.errstate(invalid="ignore"):
        return np.where(np.isnan(severities), "n/a",
                        np.where(severities > 1, "fail", np.where(severities > warn_at, "warn", "pass")))
