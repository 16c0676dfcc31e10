"""Pair the records of two dumps (one rank each).

Calls are grouped by (step, direction, module). Where both sides have the same call names in the
same order, calls pair by name. Elsewhere the module's two call sequences are aligned on tokens
(API, and role/shape/dtype of every tensor): runs of equal tokens are collapsed, the common
prefix and suffix of runs are paired directly, the rest is diffed (Myers' O(ND) shortest edit
script, difflib when the module differs in thousands of calls),
and runs of different lengths are matched element by element to the closest tensor norms. Because
names count calls per module, a difference in one module never disturbs another, and the work
is linear in the number of calls plus the (small) differing middles.
Records of paired calls then pair on (role, arg_index); nothing is dropped: unpaired records are
kept as only_a / only_b.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence

import numpy as np

from pi0align.compare.reading.records import CODED_COLUMNS
from pi0align.compare.table import Groups, Table, concatenated, gather, key_codes, lookup, outer_join, recoded

_MAX_RUN_DP = 1_000_000  # cells; larger runs pair in order instead of by closeness
_MAX_EDITS = 2000  # beyond this many insertions + deletions in one module, difflib takes over


def pair_records(a: Table, b: Table) -> Table:
    """Columns ia, ib (row positions in a and b, -1 when absent) and pairing, one row per pair."""
    (calls_a, norms_a), (calls_b, norms_b) = _calls(a), _calls(b)
    n = len(calls_a)
    for column in ("token", "api"):
        codes, _ = key_codes(concatenated(calls_a.coded(column), calls_b.coded(column)))
        calls_a[f"{column}_code"], calls_b[f"{column}_code"] = codes[:n], codes[n:]
    call_pairs = _pair_calls(calls_a, calls_b, norms_a, norms_b)

    # each record of a, with the call of b its call pairs with (-1: none)
    steps_a, steps_b = a["step"].astype(np.int64), b["step"].astype(np.int64)
    pair_of = lookup([steps_a, a["call"].astype(np.int64)], [call_pairs["step"], call_pairs["call_a"]])
    call_b = gather(call_pairs["call_b"], pair_of, -1)
    label = gather(call_pairs["label"], pair_of, "").astype(object)
    ia, ib = outer_join([steps_a, call_b, a.coded("role"), a["arg_index"].astype(np.int64)],
                       [steps_b, b["call"].astype(np.int64), b.coded("role"), b["arg_index"].astype(np.int64)])
    pairing = gather(label, ia, "").astype(object)
    pairing[ib < 0] = "only_a"
    pairing[ia < 0] = "only_b"
    paired = (ia >= 0) & (ib >= 0)
    pa, pb = ia[paired], ib[paired]
    shape_diff = a["shape"][pa] != b["shape"][pb]
    dtype_diff = a["dtype"][pa] != b["dtype"][pb]
    pairing[paired] = np.where(shape_diff, "shape_mismatch", np.where(dtype_diff, "dtype_mismatch", pairing[paired]))
    return Table({"ia": ia, "ib": ib, "pairing": pairing})


def _calls(records: Table) -> tuple[Table, np.ndarray]:
    """One row per call, in order of step and seq: step, call, seq, name, module, api, direction,
    token, and norm_start/norm_end: where its records' norms are in the array returned with it
    (the tie-break between equal calls)."""
    step, call = records["step"].astype(np.int64), records["call"].astype(np.int64)
    role_codes = records.coded("role").codes
    ordered = np.lexsort((records["arg_index"].astype(np.int64), role_codes, call, step))
    step, call = step[ordered], call[ordered]
    starts = np.flatnonzero(np.r_[True, (step[1:] != step[:-1]) | (call[1:] != call[:-1])]) if len(step) else \
        np.array([], np.int64)
    # each record's part of its call's token, made once per distinct (role, shape, dtype)
    parts = recoded(lambda role, shape, dtype: f"{role}:{shape}:{dtype}|",
                    *(records.coded(c) for c in ("role", "shape", "dtype"))).take(ordered).values
    first = ordered[starts]
    calls = Table({c: records.coded(c).take(first) if c in CODED_COLUMNS else records[c][first]
                   for c in ("step", "call", "seq", "name", "module", "api", "direction")}, length=len(starts))
    signature = np.add.reduceat(parts, starts) if len(starts) else np.array([], object)
    calls["token"] = calls["api"].astype(object) + "|" + signature
    calls["norm_start"], calls["norm_end"] = starts, np.r_[starts[1:], len(step)] if len(starts) else starts
    norms = records["norm"].astype(np.float64)[ordered]
    return calls.take(np.lexsort((calls["seq"].astype(np.int64), calls["step"].astype(np.int64)))), norms


def _pair_calls(calls_a: Table, calls_b: Table, norms_a: np.ndarray, norms_b: np.ndarray) -> Table:
    """Pairs of calls (step, call_a, call_b, label "matched" or "realigned") within each
    (step, direction, module): by position where both sides have the same names in the same
    order (the usual case, for all such groups at once), else by aligning the two sequences."""
    n = len(calls_a)
    groups = Groups(np.concatenate([calls_a["step"], calls_b["step"]]),
                    *(concatenated(calls_a.coded(k), calls_b.coded(k)) for k in ("direction", "module")))
    group_a, group_b = groups.codes[:n], groups.codes[n:]
    order_a, order_b = np.argsort(group_a, kind="stable"), np.argsort(group_b, kind="stable")  # group after group
    count_a, count_b = np.bincount(group_a, minlength=len(groups)), np.bincount(group_b, minlength=len(groups))
    # groups with as many calls on both sides line up row for row in order_a and order_b
    same_length = count_a == count_b
    rows_a, rows_b = order_a[same_length[group_a[order_a]]], order_b[same_length[group_b[order_b]]]
    renamed = np.zeros(len(groups), bool)
    renamed[group_a[rows_a][calls_a["name"][rows_a] != calls_b["name"][rows_b]]] = True
    by_position = same_length & ~renamed
    paired_a, paired_b = [rows_a[by_position[group_a[rows_a]]]], [rows_b[by_position[group_b[rows_b]]]]
    start_a, start_b = np.cumsum(count_a) - count_a, np.cumsum(count_b) - count_b
    for group in np.flatnonzero(~by_position & (count_a > 0) & (count_b > 0)):
        idx_a = order_a[start_a[group]:start_a[group] + count_a[group]]
        idx_b = order_b[start_b[group]:start_b[group] + count_b[group]]
        pos = align_sequences(calls_a["token_code"][idx_a], calls_b["token_code"][idx_b],
                              calls_a["api_code"][idx_a], calls_b["api_code"][idx_b],
                              _norms(calls_a, norms_a, idx_a), _norms(calls_b, norms_b, idx_b))
        pos_a, pos_b = (np.array(p, dtype=np.int64) for p in zip(*pos)) if pos else (np.array([], np.int64),) * 2
        paired_a.append(idx_a[pos_a])
        paired_b.append(idx_b[pos_b])
    ga, gb = np.concatenate(paired_a), np.concatenate(paired_b)
    return Table({"step": calls_a["step"][ga].astype(np.int64), "call_a": calls_a["call"][ga].astype(np.int64),
                  "call_b": calls_b["call"][gb].astype(np.int64),
                  "label": np.where(calls_a["name"][ga] == calls_b["name"][gb], "matched", "realigned").astype(object)})


def _norms(calls: Table, norms: np.ndarray, rows: np.ndarray) -> list[np.ndarray]:
    """The tensor norms of each of these calls."""
    return [norms[start:end] for start, end in zip(calls["norm_start"][rows], calls["norm_end"][rows])]


def align_sequences(tokens_a: Sequence[int], tokens_b: Sequence[int], apis_a: Sequence[int] = (),
                    apis_b: Sequence[int] = (), norms_a: Sequence = (),
                    norms_b: Sequence = ()) -> list[tuple[int, int]]:
    """Order-preserving pairs (i, j) of positions with equal tokens, plus, inside differing
    stretches, equal APIs (calls whose shape or dtype changed); closest norms break ties."""
    runs_a, runs_b = _runs(tokens_a), _runs(tokens_b)
    pairs: list[tuple[int, int]] = []
    for ra, rb in _diff(runs_a[0], runs_b[0]):
        start_a, count_a = runs_a[1][ra], runs_a[2][ra]
        start_b, count_b = runs_b[1][rb], runs_b[2][rb]
        pairs += [(start_a + i, start_b + j) for i, j in _match_run(
            count_a, count_b, norms_a[start_a:start_a + count_a] if len(norms_a) else (),
            norms_b[start_b:start_b + count_b] if len(norms_b) else ())]
    pairs = _fill_gaps(pairs, tokens_a, tokens_b)  # calls left over when runs had different lengths
    return _fill_gaps(pairs, apis_a, apis_b) if len(apis_a) else pairs


def _fill_gaps(pairs: list[tuple[int, int]], keys_a: Sequence, keys_b: Sequence) -> list[tuple[int, int]]:
    """Add pairs of equal keys among the unpaired positions between consecutive pairs."""
    result: list[tuple[int, int]] = []
    next_a = next_b = 0
    for i, j in pairs + [(len(keys_a), len(keys_b))]:
        if i > next_a and j > next_b:
            result += [(next_a + x, next_b + y) for x, y in _diff(list(keys_a[next_a:i]), list(keys_b[next_b:j]))]
        result.append((i, j))
        next_a, next_b = i + 1, j + 1
    return result[:-1]


def _runs(tokens: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
    """Run-length encoding: (token of each run, start, length)."""
    arr = np.asarray(tokens)
    if len(arr) == 0:
        return [], [], []
    starts = np.flatnonzero(np.r_[True, arr[1:] != arr[:-1]])
    lengths = np.diff(np.r_[starts, len(arr)])
    return arr[starts].tolist(), starts.tolist(), lengths.tolist()


def _diff(a: list[int], b: list[int]) -> list[tuple[int, int]]:
    """Matched positions of two token lists: common prefix and suffix directly, Myers between."""
    n, m = len(a), len(b)
    prefix = 0
    while prefix < min(n, m) and a[prefix] == b[prefix]:
        prefix += 1
    suffix = 0
    while suffix < min(n, m) - prefix and a[n - 1 - suffix] == b[m - 1 - suffix]:
        suffix += 1
    pairs = [(i, i) for i in range(prefix)]
    middle_a, middle_b = a[prefix:n - suffix], b[prefix:m - suffix]
    middle = _myers(middle_a, middle_b, _MAX_EDITS)
    if middle is None:  # very different sequences: difflib, slower in theory but bounded in practice
        matcher = difflib.SequenceMatcher(None, middle_a, middle_b, autojunk=False)
        middle = [(block.a + k, block.b + k) for block in matcher.get_matching_blocks() for k in range(block.size)]
    pairs += [(prefix + i, prefix + j) for i, j in middle]
    pairs += [(n - suffix + k, m - suffix + k) for k in range(suffix)]
    return pairs


def _myers(a: list, b: list, max_edits: int) -> list[tuple[int, int]] | None:
    """Matched positions of a shortest edit script (Myers 1986, O((N+M)·D) for D edits), or None
    when more than max_edits insertions and deletions are needed."""
    n, m = len(a), len(b)
    limit = min(max_edits, n + m)
    v = [0] * (2 * limit + 2)  # v[k]: furthest x on diagonal k (negative k wraps around)
    trace = []
    for d in range(limit + 1):
        trace.append(v[:])
        for k in range(-d, d + 1, 2):
            x = v[k + 1] if k == -d or (k != d and v[k - 1] < v[k + 1]) else v[k - 1] + 1
            y = x - k
            while x < n and y < m and a[x] == b[y]:
                x, y = x + 1, y + 1
            v[k] = x
            if x >= n and y >= m:
                return _backtrack(trace, n, m)
    return None


def _backtrack(trace: list[list[int]], x: int, y: int) -> list[tuple[int, int]]:
    pairs = []
    for d in range(len(trace) - 1, -1, -1):
        v, k = trace[d], x - y
        prev_k = k + 1 if k == -d or (k != d and v[k - 1] < v[k + 1]) else k - 1
        prev_x = v[prev_k]
        prev_y = prev_x - prev_k
        while x > prev_x and y > prev_y:
            x, y = x - 1, y - 1
            pairs.append((x, y))
        if d > 0:
            x, y = prev_x, prev_y
    pairs.reverse()
    return pairs


def _match_run(count_a: int, count_b: int, norms_a: Sequence, norms_b: Sequence) -> list[tuple[int, int]]:
    """Pair a run of k equal-token calls with a run of m: in order when k == m, else the
    order-preserving choice of min(k, m) pairs with the closest tensor norms (dynamic programming)."""
    if count_a == count_b or not len(norms_a) or count_a * count_b > _MAX_RUN_DP:
        return [(i, i) for i in range(min(count_a, count_b))]
    swap = count_a > count_b
    short, long_ = (norms_b, norms_a) if swap else (norms_a, norms_b)
    k, m = len(short), len(long_)
    cost = np.array([[_distance(s, t) for t in long_] for s in short])
    # best[i, j]: least cost of pairing short[:i] within long_[:j]
    best = np.full((k + 1, m + 1), np.inf)
    best[0, :] = 0.0
    for i in range(1, k + 1):
        for j in range(i, m + 1):
            best[i, j] = min(best[i, j - 1], best[i - 1, j - 1] + cost[i - 1, j - 1])
    pairs, i, j = [], k, m
    while i > 0:
        if best[i, j] == best[i, j - 1] and j > i:
            j -= 1
        else:
            pairs.append((i - 1, j - 1))
            i, j = i - 1, j - 1
    pairs.reverse()
    return [(j, i) for i, j in pairs] if swap else pairs


def _distance(norms_a: tuple, norms_b: tuple) -> float:
    """How different two calls' tensors look: summed |log| ratio of their norms."""
    a = np.log(np.nan_to_num(np.asarray(norms_a, np.float64)) + 1e-30)
    b = np.log(np.nan_to_num(np.asarray(norms_b, np.float64)) + 1e-30)
    return float(np.abs(a - b).sum()) if a.shape == b.shape else np.inf
