"""Which records hold the same tensor, and which records computed the tensor a record holds.

A call's input is explained only by what made it: the record of the call (or parameter, or batch)
that produced the same tensor. Two records hold the same tensor when, on both sides, they hold the
same bits: equal checksums, or, in dumps without checksums (msprobe's), equal statistics, which
are computed the same way each time a tensor is recorded. Both sides must match: a tensor that one
side changed in between (an in-place operation that was not dumped) is not the same tensor.
"""

from __future__ import annotations

import numpy as np

from pi0align.compare.judging.modules import is_module_api, within
from pi0align.compare.reading.records import OUTPUT_ROLES, function_names
from pi0align.compare.result import COMPARABLE
from pi0align.compare.table import Coded, Table, key_codes, lookup

RESULT_ROLES = (*OUTPUT_ROLES, "parameter")  # what a call, a parameter or the batch hands on
_FINGERPRINT = ("min", "max", "mean", "norm")
# calls that hand on their input's values (a dtype conversion, a copy): one that runs on one side
# only (`.float()` of a bf16 tensor; of a float32 one it is no call) hands on its input's tensor
VALUE_PRESERVING = frozenset({"float", "double", "half", "bfloat16", "to", "type_as", "type", "contiguous", "clone",
                              "detach"})


def tensor_identities(rows: Table) -> np.ndarray:
    """A code per row for the tensor its two records hold (equal codes: the same tensor, within a
    rank and step); -1 where that cannot be told (a record on one side only, no checksum and no
    statistics)."""
    n = len(rows)
    paired = rows.isin("pairing", *COMPARABLE)
    checksum_a, checksum_b = (_through_one_sided_copies(rows, side) for side in "ab")
    by_checksum = paired & (checksum_a != -1) & (checksum_b != -1)
    stats = np.column_stack([rows[f"{s}_{side}"].astype(np.float64) for s in _FINGERPRINT for side in "ab"])
    by_statistics = paired & ~by_checksum & np.isfinite(stats).all(axis=1)
    identity = np.full(n, -1, np.int64)
    common = (rows["rank"], rows["step"], rows.coded("shape_a"), rows.coded("dtype_a"))
    offset = 0
    for mask, keys in ((by_checksum, (checksum_a, checksum_b)), (by_statistics, tuple(stats.T))):
        if mask.any():
            codes, count = key_codes(*(k.take(mask) if isinstance(k, Coded) else k[mask] for k in (*common, *keys)))
            identity[mask] = codes + offset
            offset += count
    return identity


def produced(rows: Table, identity: np.ndarray, results: np.ndarray) -> np.ndarray:
    """Per row, the first row among `results` (a mask) that holds the same tensor, -1 where none does."""
    known = identity >= 0
    producers = np.flatnonzero(results & known)
    found = np.full(len(rows), -1, np.int64)
    if len(producers):
        at = lookup([identity[known]], [identity[producers]])
        found[known] = np.where(at >= 0, producers[np.maximum(at, 0)], -1)
    return found


def _through_one_sided_copies(rows: Table, side: str) -> np.ndarray:
    """One side's checksums, where the result of a VALUE_PRESERVING call that ran on that side only
    takes what it was handed's checksum: forward, its output its input's; backward, the gradient
    it sends back the one it received."""
    checksum = rows[f"checksum_{side}"].astype(np.int64)
    alone = (rows["pairing"] == f"only_{side}") & (rows["arg_index"] == 0)
    at = np.flatnonzero(alone)  # few: the function names of these only
    alone[at] = np.isin(function_names(rows["api"][at]), list(VALUE_PRESERVING))
    keys = [rows[k] for k in ("rank", "step", "name", "direction")]
    copied = {}
    for handed, result in (("input", "output"), ("grad_output", "grad_input")):
        sources = np.flatnonzero(alone & (rows["role"] == handed))
        results = np.flatnonzero(alone & (rows["role"] == result))
        if not len(sources) or not len(results):
            continue
        of = lookup([k[results] for k in keys], [k[sources] for k in keys])
        pairs = zip(checksum[results[of >= 0]].tolist(), checksum[sources[of[of >= 0]]].tolist())
        copied.update({made: handed_on for made, handed_on in pairs if made != -1 and handed_on != -1})
    return np.array([copied.get(c, c) for c in checksum.tolist()], np.int64) if copied else checksum


def requires_grad(rows: Table) -> np.ndarray:
    """Per row, whether its tensor requires a gradient: 1, 0, or -1 where the dumps do not say
    (msprobe's say; ours record the batch and the parameters instead)."""
    return np.where(rows["requires_grad_a"] >= 0, rows["requires_grad_a"], rows["requires_grad_b"])


def gradient_sources(rows: Table, identity: np.ndarray, error: np.ndarray,
                     failing: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """What a gradient is made of: autograd sums the gradients that a tensor's readers send back.
    Per gradient row (a backward call's `grad_output`, a `parameter_grad`): the largest relative
    error that sum can have, Σ e_i ‖g_i‖ / ‖g‖ over the readers' gradients g_i (the triangle
    inequality; NaN where no reader of the tensor was dumped), and whether a reader's gradient fails."""
    n = len(rows)
    direction, role, arg = rows["direction"], rows["role"], rows["arg_index"]
    names = (rows["rank"], rows["step"], rows["name"])
    # the tensor each gradient belongs to: its call's forward output, or the parameter itself
    tensor = np.full(n, -1, np.int64)
    for gradients, of, own_arg in (((direction == "backward") & (role == "grad_output"),
                                    (direction == "forward") & (role == "output"), arg),
                                   (role == "parameter_grad", role == "parameter", np.zeros(n, np.int64))):
        at, source = np.flatnonzero(gradients), np.flatnonzero(of)
        if len(at) and len(source):
            found = lookup([k[at] for k in names] + [own_arg[at]], [k[source] for k in names] + [arg[source]])
            tensor[at] = np.where(found >= 0, identity[source[np.maximum(found, 0)]], -1)
    readers, sent = _readers_and_sent(rows, identity)
    codes, weighted, any_fails = _sent_back(rows, identity, error, failing, readers, sent)
    bound, readers_fail = _sum_bounds(rows, tensor, codes, weighted, any_fails)
    _shared_parameters_own_readers(rows, identity, error, failing, readers, sent, tensor, bound, readers_fail)
    return bound, readers_fail


def _shared_parameters_own_readers(rows: Table, identity: np.ndarray, error: np.ndarray, failing: np.ndarray,
                                   readers: np.ndarray, sent: np.ndarray, tensor: np.ndarray, bound: np.ndarray,
                                   readers_fail: np.ndarray) -> None:
    """Where several parameters hold the same bits (every LayerNorm's weight is ones at first, and
    in bf16 long after: its updates stay under half an ulp), each one's gradient is what the
    readers inside its own module sent back (NaN where none of them was dumped), not the others'
    too: `bound` and `readers_fail` of those gradients set again."""
    gradients = np.flatnonzero(rows.isin("role", "parameter_grad") & (tensor >= 0))
    _, inverse, counts = np.unique(tensor[gradients], return_inverse=True, return_counts=True)
    shared = gradients[counts[inverse] > 1]
    if not len(shared):
        return
    reader_tensor = identity[readers]
    reader_module = rows["module"][readers]
    norm = rows["norm_a"].astype(np.float64)
    for gradient in shared.tolist():
        module = str(rows["module"][gradient])
        same = np.flatnonzero(reader_tensor == tensor[gradient])
        mine = sent[same[[within(path, module) for path in reader_module[same].tolist()]]]
        if not len(mine):
            bound[gradient], readers_fail[gradient] = np.nan, False
            continue
        with np.errstate(invalid="ignore"):
            total = float(np.sum(np.where(norm[mine] > 0, error[mine] * norm[mine], 0.0)))
        own = norm[gradient]
        bound[gradient] = total / own if own > 0 else (np.inf if total > 0 else 0.0)
        readers_fail[gradient] = bool(failing[mine].any())


def accumulated_gradient_sources(rows: Table, identity: np.ndarray, error: np.ndarray, failing: np.ndarray,
                                 gradients: np.ndarray, leaves: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The same for the gradients a step's update reads where no parameter gradient was recorded
    (msprobe's `update` calls): each is what the readers of one parameter sent back, and since
    which one is not recorded, the largest bound among the tensors read in forward that require a
    gradient (`leaves`) of the gradient's shape and dtype. Per row in `gradients`."""
    n = len(rows)
    codes, weighted, any_fails = _sent_back(rows, identity, error, failing, *_readers_and_sent(rows, identity))
    leaf = np.flatnonzero(leaves & (identity >= 0))
    place = np.searchsorted(codes, identity[leaf])
    sent = place < len(codes)
    sent[sent] &= codes[place[sent]] == identity[leaf[sent]]
    leaf, place = leaf[sent], place[sent]
    keys = ("rank", "step", "shape_a", "dtype_a")
    worst: dict[tuple, tuple[float, bool]] = {}
    for row, at in zip(leaf.tolist(), place.tolist()):
        key = tuple(rows[k][row] for k in keys)
        total, fails = worst.get(key, (0.0, False))
        worst[key] = (max(total, weighted[at]), fails or bool(any_fails[at]))
    bound, readers_fail = np.full(n, np.nan), np.zeros(n, bool)
    norm = rows["norm_a"].astype(np.float64)
    for row in np.flatnonzero(gradients).tolist():
        found = worst.get(tuple(rows[k][row] for k in keys))
        if found is not None:
            bound[row] = found[0] / norm[row] if norm[row] > 0 else (np.inf if found[0] > 0 else 0.0)
            readers_fail[row] = found[1]
    return bound, readers_fail


def _readers_and_sent(rows: Table, identity: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The forward inputs whose tensor is known, each with the gradient its call sent back for it
    (rows of both, alike in length). A module and the calls inside it read the same tensor, and
    autograd sums only what the innermost sent: the API calls' where there are any, else the
    modules' of the longest path."""
    direction, role, arg = rows["direction"], rows["role"], rows["arg_index"]
    names = (rows["rank"], rows["step"], rows["name"])
    readers = np.flatnonzero((direction == "forward") & (role == "input") & (identity >= 0))
    readers = readers[_innermost_readers(rows, identity, readers)]
    sent = np.flatnonzero((direction == "backward") & (role == "grad_input"))
    at = lookup([k[readers] for k in names] + [arg[readers]], [k[sent] for k in names] + [arg[sent]])
    return readers[at >= 0], sent[at[at >= 0]]


def _sent_back(rows: Table, identity: np.ndarray, error: np.ndarray, failing: np.ndarray, readers: np.ndarray,
               sent: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per tensor read in forward (its identity code, sorted): Σ e_i ‖g_i‖ over the gradients its
    readers sent back (`_readers_and_sent`), and whether one of them fails."""
    norm = rows["norm_a"].astype(np.float64)
    codes, inverse = np.unique(identity[readers], return_inverse=True)
    with np.errstate(invalid="ignore"):
        amounts = np.where(norm[sent] > 0, error[sent] * norm[sent], 0.0)
    # a gradient sent back that was not measured (one side only) leaves the sum's bound unknown (NaN)
    weighted = np.bincount(inverse, amounts, len(codes))
    any_fails = np.bincount(inverse, failing[sent], len(codes)) > 0
    return codes, weighted, any_fails


def _sum_bounds(rows: Table, tensor: np.ndarray, codes: np.ndarray, weighted: np.ndarray,
                any_fails: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row holding the gradient of `tensor` (an identity code, -1: none): Σ e_i ‖g_i‖ / ‖g‖ and
    whether a reader's gradient fails (NaN, False where no reader sent one back)."""
    n = len(rows)
    bound, readers_fail = np.full(n, np.nan), np.zeros(n, bool)
    norm = rows["norm_a"].astype(np.float64)
    place = np.searchsorted(codes, tensor)
    known = (tensor >= 0) & (place < len(codes))
    known[known] &= codes[place[known]] == tensor[known]
    with np.errstate(divide="ignore", invalid="ignore"):
        own = norm[known]
        total = weighted[place[known]]
        bound[known] = np.where(own > 0, total / np.where(own > 0, own, 1.0), np.where(total > 0, np.inf, 0.0))
    readers_fail[known] = any_fails[place[known]]
    return bound, readers_fail


def _innermost_readers(rows: Table, identity: np.ndarray, readers: np.ndarray) -> np.ndarray:
    """Mask over `readers` (forward input rows): of the readers of each tensor, the API calls, or,
    where only modules read it, those of the deepest module path."""
    module = is_module_api(rows.coded("api").take(readers))
    depth = np.where(module, np.array([str(m).count(".") + bool(m) for m in rows["module"][readers].tolist()]), 1 << 20)
    codes, inverse = np.unique(identity[readers], return_inverse=True)
    deepest = np.full(len(codes), -1, np.int64)
    np.maximum.at(deepest, inverse, depth)
    return depth == deepest[inverse]
