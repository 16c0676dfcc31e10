"""Error metrics between a benchmark tensor B (side a) and a tensor under test N (side b).

Pure functions over arrays, float64 throughout, vectorised over rows so that one code path serves
a whole step's samples at once (rows = records) and a full tensor streamed in chunks (rows = 1).
Every input has a defined answer, without warnings: see docs/compare.md for the definitions.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from pi0align.compare.measuring.kernels import FIELDS, SUMMED, CompiledLoops, NumpyLoops, comparison_loops
from pi0align.compare.reading.records import Bfloat16Array, iter_flat_chunks

TENSOR_METRICS = ["cosine", "max_abs_err", "max_rel_err", "mean_rel_err", "rel_l2_err", "rmse",
                  "within_1e-3", "within_5e-3", "nan_inf_mismatch", "max_row_rel_l2_err"]
STATS_METRICS = ["min_rel_err", "max_val_rel_err", "mean_val_rel_err", "norm_rel_err"]
WORKERS = min(4, os.cpu_count() or 1)
_AA, _DD, _MAX_ROW_REL = (FIELDS.index(field) for field in ("aa", "dd", "max_row_rel"))
CHUNK_ELEMENTS = 1 << 18  # elements read per side at a time from arrays not stored in HDF5 chunks


def relative(diff: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """diff / scale, where 0/0 = 0, x/0 = inf, NaN diff stays NaN."""
    diff, scale = np.asarray(diff, np.float64), np.asarray(scale, np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(scale > 0, diff / np.where(scale > 0, scale, 1.0), np.where(diff > 0, np.inf, diff * 0.0))


Loops = CompiledLoops | NumpyLoops


class ErrorAccumulator:
    """Running sums of the error between a and b, per row; add chunks, merge, then read result().
    The sums come from `loops` (kernels.py: compiled, or numpy's)."""

    def __init__(self, rows: int, loops: Loops):
        self._sums = np.zeros((rows, len(FIELDS)))
        self._scratch: dict = {}
        self._loops = loops

    def add(self, a: np.ndarray, b: np.ndarray, bfloat16: bool = False, row_length: int = 0) -> None:
        """a, b: one row (1-D) or rows (2-D) at the same positions, any numeric dtype;
        bfloat16: both hold raw bfloat16 bits (uint16); row_length: each row is whole tensor rows of
        that many elements, whose largest relative L2 error is taken (0: it is not)."""
        self._loops.error_sums(np.atleast_2d(a), np.atleast_2d(b), bfloat16, self._sums, self._scratch, row_length)

    def merge(self, other: ErrorAccumulator) -> None:
        self._sums[:, :SUMMED] += other._sums[:, :SUMMED]
        np.maximum(self._sums[:, SUMMED:], other._sums[:, SUMMED:], out=self._sums[:, SUMMED:])

    @property
    def sums(self) -> np.ndarray:
        """The sums so far, rows x len(FIELDS)."""
        return self._sums

    def result(self) -> dict[str, np.ndarray]:
        return metrics_of_sums(self._sums)


def metrics_of_sums(sums: np.ndarray) -> dict[str, np.ndarray]:
    """TENSOR_METRICS per row of sums (rows x len(FIELDS), as ErrorAccumulator gathers them): of
    many tensor pairs at once, each pair's sums a row (tensor_sums)."""
    s = dict(zip(FIELDS, np.asarray(sums, np.float64).T))
    norm_a, norm_b = np.sqrt(s["aa"]), np.sqrt(s["bb"])
    with np.errstate(invalid="ignore", divide="ignore"):
        cosine = np.where((norm_a > 0) & (norm_b > 0),
                          np.clip(s["ab"] / np.maximum(norm_a * norm_b, np.finfo(float).tiny), -1, 1),
                          np.where((norm_a == 0) & (norm_b == 0), 1.0, 0.0))
        n = np.where(s["n"] > 0, s["n"], np.nan)  # no finite element: metrics are NaN, not a crash
        out = {
            "cosine": cosine,
            "max_abs_err": s["max_abs"],
            "max_rel_err": s["max_rel"],
            "mean_rel_err": s["rel"] / n,
            "rel_l2_err": relative(np.sqrt(s["dd"]), norm_a),
            "rmse": np.sqrt(s["dd"] / n),
            "within_1e-3": s["w1"] / n,
            "within_5e-3": s["w5"] / n,
            # the worst row along the last dimension (the product bound of a per-row scale, bounds.py)
            "max_row_rel_l2_err": s["max_row_rel"],
        }
    for key in out:
        out[key] = np.where(np.isnan(n), np.nan, out[key])
    out["nan_inf_mismatch"] = s["mismatch"].copy()
    return out


def tensor_sums(a: Any, b: Any, chunk_elements: int = CHUNK_ELEMENTS, workers: int = WORKERS,
                loops: Loops | None = None) -> np.ndarray:
    """The sums (FIELDS) of the error between two same-shape array-likes (h5py datasets, memmaps),
    read chunk by chunk: a row for metrics_of_sums, which takes many pairs' rows at once. Chunked
    HDF5 datasets are read and decoded chunk by chunk, as stored, by `workers` threads
    (h5chunks.py); other arrays are read `chunk_elements` at a time, in row ranges whose
    arithmetic, which releases the GIL, runs in parallel; arrays already in memory and of one
    chunk at most are summed in one pass as they are. `loops`: the compiled loops where they build,
    unless given. The rows whose largest error is taken are the last dimension's: every path
    reads whole ones, but for a tensor of one dimension or none, which is one row."""
    loops = loops or comparison_loops()
    shape = tuple(np.shape(a))
    row_length = shape[-1] if len(shape) > 1 else 0  # 0: one row, measured from the sums below
    if _in_memory(a) and _in_memory(b) and np.size(a) <= chunk_elements:
        accumulators = [ErrorAccumulator(1, loops)]
        accumulators[0].add(np.reshape(a, -1), np.reshape(b, -1), row_length=row_length)
    else:
        accumulators = _reduce_stored_chunks(a, b, workers, loops, row_length) or _reduce_row_ranges(
            a, b, chunk_elements, workers, loops, row_length)
    total = accumulators[0]
    for other in accumulators[1:]:
        total.merge(other)
    sums = total.sums[0]
    if len(shape) <= 1:
        sums[_MAX_ROW_REL] = relative(np.sqrt(sums[_DD]), np.sqrt(sums[_AA]))
    return sums


def _in_memory(x: Any) -> bool:
    """An array whose elements are in memory now (a memmap's are read as they are touched)."""
    return isinstance(x, (np.ndarray, np.generic)) and not isinstance(x, np.memmap)


def _reduce_stored_chunks(a: Any, b: Any, workers: int, loops: Loops, row_length: int) -> list[ErrorAccumulator] | None:
    # imported here: h5chunks loads hdf5plugin, needed only once tensors are read
    from pi0align.compare.reading.h5chunks import ChunkBuffers, chunk_pairs

    bfloat16 = isinstance(a, Bfloat16Array)
    if bfloat16 != isinstance(b, Bfloat16Array):
        return None
    stored = chunk_pairs(a.bits, b.bits, loops) if bfloat16 else chunk_pairs(a, b, loops)
    if stored is None:
        return None
    reader_a, reader_b, jobs = stored
    if reader_a.chunks[-1] != row_length:  # a chunk holds parts of rows (rows longer than a chunk)
        row_length = 0

    def reduce(part: list) -> ErrorAccumulator:
        acc = ErrorAccumulator(1, loops)
        buffers_a, buffers_b = ChunkBuffers(), ChunkBuffers()
        for offset, where_a, where_b in part:
            chunk_a, chunk_b = reader_a.read(offset, where_a, buffers_a), reader_b.read(offset, where_b, buffers_b)
            acc.add(chunk_a.reshape(-1), chunk_b.reshape(-1), bfloat16, row_length)
        return acc

    try:
        count = max(1, min(workers, len(jobs)))
        parts = [jobs[i * len(jobs) // count:(i + 1) * len(jobs) // count] for i in range(count)]
        if len(parts) == 1:
            return [reduce(parts[0])]
        return _in_threads(reduce, parts)
    finally:
        reader_a.close()
        reader_b.close()


def _reduce_row_ranges(a: Any, b: Any, chunk_elements: int, workers: int, loops: Loops,
                       row_length: int) -> list[ErrorAccumulator]:
    rows = a.shape[0] if len(a.shape) else 1
    per_row = max(1, int(np.prod(a.shape[1:], dtype=np.int64))) if len(a.shape) else 1
    parts = min(workers, max(1, rows * per_row // (4 * chunk_elements)), rows)

    def reduce(lo: int, hi: int) -> ErrorAccumulator:
        acc = ErrorAccumulator(1, loops)
        view_a, view_b = (_RowRange(x, lo, hi) for x in (a, b)) if len(a.shape) else (a, b)
        for chunk_a, chunk_b in iter_flat_chunks(view_a, view_b, chunk_elements):  # whole first-axis rows
            acc.add(chunk_a, chunk_b, row_length=row_length)
        return acc

    bounds = np.linspace(0, rows, parts + 1).astype(int)
    if parts == 1:
        return [reduce(0, rows)]
    return _in_threads(reduce, bounds[:-1], bounds[1:])


def _in_threads(function, *arguments) -> list:
    """list(map(function, *arguments)), a thread per call (the kernels and HDF5's reads release the GIL)."""
    from concurrent.futures import ThreadPoolExecutor  # here: a compare of statistics reads no tensors

    with ThreadPoolExecutor(len(arguments[0])) as pool:
        return list(pool.map(function, *arguments))


class _RowRange:
    """Rows lo:hi of an array-like, sliceable along its first axis without reading it."""

    def __init__(self, array: Any, lo: int, hi: int):
        self.array, self.lo = array, lo
        self.shape = (hi - lo, *array.shape[1:])

    def __getitem__(self, index: slice) -> np.ndarray:
        start, stop, _ = index.indices(self.shape[0])
        return self.array[self.lo + start:self.lo + stop]


def sample_metrics(values_a: np.ndarray, values_b: np.ndarray, loops: Loops | None = None) -> dict[str, np.ndarray]:
    """Metrics per row of two (rows, samples) arrays; unused sample slots must be NaN on both sides."""
    acc = ErrorAccumulator(len(values_a), loops or comparison_loops())
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
