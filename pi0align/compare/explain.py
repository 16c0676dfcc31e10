"""Which failing rows the noise model explains, and whether two runs are bit-comparable.

A failing row is judged `warn` (within noise) when it ran before its rank's first culprit and the
noise model explains it (docs/compare.md, "Explained rows"); bit-comparable runs are judged by
their checksums (judge.py, `exact`).
"""

from __future__ import annotations

import numpy as np

from pi0align.compare.judge import Judgement, containing
from pi0align.compare.records import OUTPUT_ROLES
from pi0align.compare.rootcause import phases
from pi0align.compare.table import Table, gather, isin, lookup


def _before_first(rows: Table, calls: Table, judgement: Judgement) -> np.ndarray:
    """Rows that ran before the rank's first culprit, in execution order (by step, the step's
    phase, then sequence: parameters, data, forward, backward, the optimizer): those after it may
    inherit its error, and stay failing where they exceed their limits."""
    before = np.ones(len(rows), bool)
    row_phase, call_phase = phases(rows["direction"]), phases(calls["direction"])
    seq = rows["seq_a"].astype(np.float64)
    for rank in np.unique(calls["rank"][judgement.culprit]).tolist():
        guilty = judgement.culprit & (calls["rank"] == rank)
        step, phase, first = min(zip(calls["step"][guilty].tolist(), call_phase[guilty].tolist(),
                                     calls["seq_a"][guilty].tolist()))
        after = (rows["step"] > step) | ((rows["step"] == step) & (
            (row_phase > phase) | ((row_phase == phase) & ~(seq < first))))
        before &= ~((rows["rank"] == rank) & after)
    return before


def identical_values(rows: Table) -> np.ndarray:
    """Rows whose two records hold the same bits (equal checksums, both known)."""
    a, b = rows["checksum_a"].astype(np.int64), rows["checksum_b"].astype(np.int64)
    return (a == b) & (a != -1) & (b != -1) & isin(rows["pairing"], ("matched", "realigned"))


def data_differ(rows: Table) -> np.ndarray:
    """Data records (the batch) of one dtype whose bits differ: the batch is read, not computed, so
    it holds no rounding noise, and one changed sample in sixteen moves its statistics less than
    bf16's limits."""
    known = (rows["checksum_a"] != -1) & (rows["checksum_b"] != -1) & (rows["dtype_a"] == rows["dtype_b"])
    return (rows["direction"] == "data") & known & ~rows["identical"] & isin(rows["pairing"], ("matched", "realigned"))


SAME_NUMERICS = ("device", "device_name", "dtype", "world_size", "numerics", "versions.torch", "versions.torch_npu",
                 "versions.cann")


def bit_comparable(rows: Table, diff: list, manifest: dict) -> bool:
    """The two runs compute bit for bit alike: the same device, dtype, threads and numerics switches
    and torch (their manifests agree on SAME_NUMERICS), deterministic algorithms on an accelerator
    (atomics make its runs differ from one another), and the first forward API call of the first
    step (in a module-level dump, its first module holding no other) is handed and returns the same
    bits on both sides. `manifest`: A's."""
    if any(key.split(".")[0] in SAME_NUMERICS or key in SAME_NUMERICS for key, _, _ in diff):
        return False
    if manifest.get("device", "cpu") != "cpu" and not (manifest.get("numerics") or {}).get("deterministic_algorithms"):
        return False
    known = (rows["checksum_a"] != -1) & (rows["checksum_b"] != -1) & (rows["direction"] == "forward")
    known &= isin(rows["pairing"], ("matched", "realigned"))
    module_call = np.char.startswith(rows["api"].astype(str), "Module.")
    first = known & ~module_call  # a module's output comes at its end
    if not first.any():
        paths = rows["module"].astype(str)
        parents = {".".join(parts[:n]) for path in set(paths[known].tolist())
                   for parts in [path.split(".") if path else []] for n in range(len(parts))}
        first = known & ~isin(paths, parents)
    if not first.any():
        return False
    first &= rows["step"] == rows["step"][first].min()
    first &= rows["seq_a"] == rows["seq_a"][first].min()
    return bool(rows["identical"][first].all())


def rows_of(rows: Table, calls: Table, selected: np.ndarray) -> np.ndarray:
    """The rows of the selected calls."""
    keys = ("rank", "step", "direction")
    call = lookup([*(rows[k] for k in keys), rows["seq_a"].astype(np.float64)],
                  [*(calls[k] for k in keys), calls["seq_a"].astype(np.float64)])
    return gather(selected, call, False).astype(bool)


def _explained(rows: Table, calls: Table, judgement: Judgement) -> np.ndarray:
    """Rows whose difference the noise model explains: results of calls judged within noise (the
    parameters and data included) and the same tensors where later calls read them (equal checksum
    in the step), gradients flowing into calls (autograd sums the results of calls judged on their
    own), parameter gradients, and the optimizer's inputs (the parameter, its gradient after the
    clipping, which is not dumped, and the states of the update before). Forward inputs nothing
    produced are not explained."""
    call_explained = rows_of(rows, calls, judgement.explained)
    role, step = rows["role"], rows["step"]
    produced = (isin(role, (*OUTPUT_ROLES, "parameter")) & call_explained) | (role == "parameter_grad")
    checksum = rows["checksum_a"].astype(np.int64)
    known = checksum != -1
    producers = set(zip(rows["rank"][produced & known].tolist(), step[produced & known].tolist(),
                        checksum[produced & known].tolist()))
    same_tensor = np.array([(r, s, c) in producers for r, s, c in
                            zip(rows["rank"].tolist(), step.tolist(), checksum.tolist())], bool) & known
    forward_input = (role == "input") & (rows["direction"] == "forward")
    optimizer_input = (role == "input") & (rows["direction"] == "optimizer")
    return (produced | (role == "grad_output") | optimizer_input
            | (forward_input & (same_tensor | (~known & call_explained))))


def explained_rows(rows: Table, calls: Table, judgement: Judgement) -> np.ndarray:
    """Failing rows the noise model explains: before the first culprit, not in a module around one."""
    explained = _explained(rows, calls, judgement) & (rows["verdict"] == "fail") & _before_first(rows, calls, judgement)
    return explained & ~rows_of(rows, calls, containing(calls, judgement.culprit))
