"""Thresholds from the noise floor: two runs on the same device that should agree up to rounding
(same seed, another thread count, or simply another run). A driver of compares, so beside the
engine rather than among the judging stages it feeds."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from pi0align.compare.engine import compare_dumps
from pi0align.compare.judging.calltable.bounds import FLOOR_UNITS
from pi0align.compare.judging.thresholds import JUDGED_ERRORS, UNIT_ROUNDOFF, load_thresholds, looser_classes
from pi0align.compare.result import COMPARABLE
from pi0align.compare.table import isin
from pi0align.errors import UserError

# The largest error between two runs of one device is one draw of its noise; other steps, other
# data draw again. Ten times it leaves room for those draws and stays below a real fault: the
# float32 default (1e-4) sits likewise a decade under a faulty kernel's 1e-3 (thresholds.py).
CALIBRATION_MARGIN = 10.0


def calibrate(path_a1: str | Path, path_a2: str | Path, *, margin: float = CALIBRATION_MARGIN,
              steps: Iterable[int] | None = None, base: dict | None = None) -> dict[str, dict[str, float]]:
    """Thresholds per dtype = margin x the largest error seen between two same-device runs, never
    below bounds.FLOOR_UNITS unit roundoffs of the dtype (two runs that happened to agree bit for
    bit must not fail the next pair's rounding). Dtypes absent from the runs keep those of `base`
    (as from load_thresholds(file, overrides); the defaults when None), as do warn fractions."""
    if not margin >= 1:
        raise UserError(f"calibration margin must be at least 1, got {margin}")
    rows = compare_dumps(path_a1, path_a2, steps=steps, thresholds=base).table()
    rows = rows.take(isin(rows["pairing"], COMPARABLE))
    classes = looser_classes(rows["dtype_a"], rows["dtype_b"]).values
    thresholds = copy.deepcopy(base) if base is not None else load_thresholds()
    for cls in set(classes):
        seen = rows.take(classes == cls)
        floor = FLOOR_UNITS * UNIT_ROUNDOFF[cls] if cls != "integer" else 0.0
        for metric in JUDGED_ERRORS:
            observed = np.nan_to_num(np.nanmax(seen[metric].astype(np.float64), initial=0.0), posinf=np.inf)
            thresholds[cls][metric] = float(observed * margin) if metric == "nan_inf_mismatch" else \
                float(max(observed * margin, floor))
        worst_cosine = np.nanmin(seen["cosine"].astype(np.float64), initial=1.0)
        thresholds[cls]["cosine"] = float(1.0 - max((1.0 - worst_cosine) * margin, floor * floor))
    return thresholds
