"""The rounding-level rule element by element, where both dumps hold full tensors.

noise.py judges whole gradients at rounding level. A fused tensor can hold a part that is zero in
exact arithmetic beside parts that are not: the key slice of a fused qkv bias, whose gradient is
rounding noise (softmax ignores a constant shift) while the query and value slices carry the
signal. There, a parameter gradient's elements that are at rounding level on both sides (below
the dtype's relative limit times the tensor's largest element on either side) are left out of its
metrics, and so are the same elements of the optimizer's update of that parameter at that step and
of the parameter at the next dumped step (Adam turns their noise into lr-sized updates) and of the
records that read it there. The statistics errors of those
records are left out too (they describe every element): they are judged on the rest, by value.

It runs with replay only: replay judges the calls that read those parameters by their local
errors, while the models without it would read a remeasured input that agrees and an output that
does not (the key slice of the qkv projection's output) as a call introducing error.
"""

from __future__ import annotations

import numpy as np

from pi0align.compare.metrics import STATS_METRICS, TENSOR_METRICS, tensor_metrics
from pi0align.compare.records import Dump, subjects
from pi0align.compare.table import Table
from pi0align.compare.thresholds import looser


def measure_without_rounding(rows: Table, paths_a: np.ndarray, paths_b: np.ndarray, a: Dump, b: Dump,
                             thresholds: dict) -> list[str]:
    """Re-measure, in place, the parameter gradients with elements at rounding level, the parameters
    they update at the next dumped step and the records reading those; a note saying how many."""
    role, rank, step, name = rows["role"], rows["rank"], rows["step"], rows["name"]
    stored = (rows["evidence"] == "tensor") & (paths_a != "") & (paths_b != "")
    parameters = np.flatnonzero(stored & (role == "parameter"))
    parameter = subjects(name)
    updates = np.flatnonzero(stored & (rows["direction"] == "optimizer"))
    measured = 0
    for i in np.flatnonzero(stored & (role == "parameter_grad")).tolist():
        grad_a, grad_b = _read(a, rows, paths_a, i), _read(b, rows, paths_b, i)
        largest = max(np.abs(grad_a).max(initial=0.0), np.abs(grad_b).max(initial=0.0))
        floor = thresholds[looser(rows["dtype_a"][i], rows["dtype_b"][i])]["rel_l2_err"] * largest
        rounding = (np.abs(grad_a) < floor) & (np.abs(grad_b) < floor)
        if not rounding.any() or rounding.all():
            continue
        keep = ~rounding
        measured += _remeasure(rows, [i], grad_a, grad_b, keep)
        for j in updates[(rank[updates] == rank[i]) & (step[updates] == step[i])
                         & (parameter[updates] == parameter[i]) & (rows["shape_a"][updates] == rows["shape_a"][i])]:
            measured += _remeasure(rows, [int(j)], _read(a, rows, paths_a, j), _read(b, rows, paths_b, j), keep)
        later = parameters[(rank[parameters] == rank[i]) & (name[parameters] == name[i]) & (step[parameters] > step[i])]
        if not len(later):
            continue
        j = later[np.argmin(step[later])]
        value_a, value_b = _read(a, rows, paths_a, j), _read(b, rows, paths_b, j)
        if value_a.size != keep.size:
            continue
        same_tensor = (rows["shape_a"] == rows["shape_a"][j]) & (rows["checksum_a"] == rows["checksum_a"][j])
        readers = np.flatnonzero(stored & (rank == rank[j]) & (step == step[j]) & same_tensor
                                 & (rows["checksum_a"] != -1))
        measured += _remeasure(rows, sorted({int(j), *readers.tolist()}), value_a, value_b, keep)
    if not measured:
        return []
    return [f"{measured} records of parameters and their gradients are measured without the elements that "
            "rounding-level gradients drive (e.g. the key slice of a fused qkv bias)"]


def _read(dump: Dump, rows: Table, paths: np.ndarray, i: int) -> np.ndarray:
    return np.asarray(dump.tensor_reader(int(rows["step"][i]), str(paths[i]))[()], np.float64).reshape(-1)


def _remeasure(rows: Table, targets: list[int], a: np.ndarray, b: np.ndarray, keep: np.ndarray) -> int:
    metrics = tensor_metrics(a[keep], b[keep])
    for i in targets:
        for metric in TENSOR_METRICS:
            rows[metric][i] = metrics[metric]
        for metric in STATS_METRICS:
            rows[metric][i] = np.nan
    return len(targets)
