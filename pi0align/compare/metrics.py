"""Error metrics between a benchmark tensor B (side a) and a tensor under test N (side b).

Pure functions over arrays, float64 throughout, vectorised over rows so that one code path serves
a whole step's samples at once (rows = records) and a full tensor streamed in chunks (rows = 1).
Every input has a defined answer, without warnings: see docs/compare.md for the definitions.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pi0align.compare.records import iter_flat_chunks

TENSOR_METRICS = ["cosine", "max_abs_err", "max_rel_err", "mean_rel_err", "rel_l2_err", "rmse",
                  "within_1e-3", "within_5e-3", "nan_inf_mismatch"]
STATS_METRICS = ["min_rel_err", "max_val_rel_err", "mean_val_rel_err", "norm_rel_err"]
CHUNK_ELEMENTS = 1 << 22  # 32 MiB of float64 per side per chunk: bounds memory for any tensor size


def relative(diff: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """diff / scale, where 0/0 = 0, x/0 = inf, NaN diff stays NaN."""
    diff, scale = np.asarray(diff, np.float64), np.asarray(scale, np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(scale > 0, diff / np.where(scale > 0, scale, 1.0), np.where(diff > 0, np.inf, diff * 0.0))


class ErrorAccumulator:
    """Running sums of the error between a and b, per row; add chunks, then read result()."""

    def __init__(self, rows: int = 1):
        self._sums = {k: np.zeros(rows) for k in ("ab", "aa", "bb", "dd", "rel", "w1", "w5", "n", "mismatch")}
        self._max_abs, self._max_rel = np.zeros(rows), np.zeros(rows)

    def add(self, a: np.ndarray, b: np.ndarray) -> None:
        """a, b: float64 arrays of shape (rows, k), same positions."""
        s = self._sums
        with np.errstate(invalid="ignore", over="ignore"):
            nan_a, nan_b = np.isnan(a), np.isnan(b)
            both = np.isfinite(a) & np.isfinite(b)
            # Same NaN pattern and same infinities count as agreement; anything else is a mismatch.
            s["mismatch"] += ((nan_a != nan_b) | (~both & ~nan_a & ~nan_b & (a != b))).sum(-1)
            a0, b0 = np.where(both, a, 0.0), np.where(both, b, 0.0)
            d = np.abs(b0 - a0)
            rel = relative(d, np.abs(a0))
            s["n"] += both.sum(-1)
            s["ab"] += (a0 * b0).sum(-1)
            s["aa"] += (a0 * a0).sum(-1)
            s["bb"] += (b0 * b0).sum(-1)
            s["dd"] += (d * d).sum(-1)
            s["rel"] += rel.sum(-1)
            s["w1"] += ((rel <= 1e-3) & both).sum(-1)
            s["w5"] += ((rel <= 5e-3) & both).sum(-1)
            self._max_abs = np.maximum(self._max_abs, d.max(-1, initial=0.0))
            self._max_rel = np.maximum(self._max_rel, rel.max(-1, initial=0.0))

    def result(self) -> dict[str, np.ndarray]:
        s = self._sums
        norm_a, norm_b = np.sqrt(s["aa"]), np.sqrt(s["bb"])
        with np.errstate(invalid="ignore", divide="ignore"):
            cosine = np.where((norm_a > 0) & (norm_b > 0),
                              np.clip(s["ab"] / np.maximum(norm_a * norm_b, np.finfo(float).tiny), -1, 1),
                              np.where((norm_a == 0) & (norm_b == 0), 1.0, 0.0))
            n = np.where(s["n"] > 0, s["n"], np.nan)  # no finite element: metrics are NaN, not a crash
            out = {
                "cosine": cosine,
                "max_abs_err": self._max_abs,
                "max_rel_err": self._max_rel,
                "mean_rel_err": s["rel"] / n,
                "rel_l2_err": relative(np.sqrt(s["dd"]), norm_a),
                "rmse": np.sqrt(s["dd"] / n),
                "within_1e-3": s["w1"] / n,
                "within_5e-3": s["w5"] / n,
            }
        for key in out:
            out[key] = np.where(np.isnan(n), np.nan, out[key])
        out["nan_inf_mismatch"] = s["mismatch"].copy()
        return out


def tensor_metrics(a: Any, b: Any, chunk_elements: int = CHUNK_ELEMENTS) -> dict[str, float]:
    """Metrics of two same-shape array-likes (h5py datasets, memmaps), read chunk by chunk."""
    acc = ErrorAccumulator(1)
    for chunk_a, chunk_b in iter_flat_chunks(a, b, chunk_elements):
        acc.add(chunk_a[None, :], chunk_b[None, :])
    return {k: float(v[0]) for k, v in acc.result().items()}


def sample_metrics(values_a: np.ndarray, values_b: np.ndarray) -> dict[str, np.ndarray]:
    """Metrics per row of two (rows, samples) arrays; unused sample slots must be NaN on both sides."""
    acc = ErrorAccumulator(len(values_a))
    acc.add(values_a, values_b)
    return acc.result()


def stats_metrics(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Relative errors of min/max/mean/norm, per row. a, b: arrays min, max, mean, norm, numel.

    Each difference is scaled by a measure of the tensor's size rather than by the statistic
    itself, so that a mean or a minimum near zero does not make a huge relative error:
    min and max by B's largest magnitude, mean by B's RMS (norm / sqrt(numel)), norm by itself.
    """

    def diff(key):
        x, y = np.asarray(a[key], np.float64), np.asarray(b[key], np.float64)
        # Both NaN (no finite element on either side) is agreement; NaN on one side is not.
        with np.errstate(invalid="ignore"):
            return np.where(np.isnan(x) & np.isnan(y), 0.0, np.where(np.isnan(x) | np.isnan(y), np.inf,
                                                                       np.abs(y - x)))

    with np.errstate(invalid="ignore", divide="ignore"):
        numel = np.maximum(np.asarray(a["numel"], np.float64), 1.0)
        rms = np.nan_to_num(np.asarray(a["norm"], np.float64)) / np.sqrt(numel)
        magnitude = np.fmax(np.abs(np.asarray(a["min"], np.float64)), np.abs(np.asarray(a["max"], np.float64)))
        magnitude = np.nan_to_num(magnitude)
        return {
            "min_rel_err": relative(diff("min"), magnitude),
            "max_val_rel_err": relative(diff("max"), magnitude),
            "mean_val_rel_err": relative(diff("mean"), rms),
            "norm_rel_err": relative(diff("norm"), np.nan_to_num(np.asarray(a["norm"], np.float64))),
        }
