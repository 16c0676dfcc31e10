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
from typing import Sequence

import numpy as np
import pandas as pd

_MAX_RUN_DP = 1_000_000  # cells; larger runs pair in order instead of by closeness
_MAX_EDITS = 2000  # beyond this many insertions + deletions in one module, difflib takes over


def pair_records(a: pd.DataFrame, b: pd.DataFrame) -> pd.DataFrame:
    """Columns ia, ib (row positions in a and b, -1 when absent) and pairing, one row per pair."""
    calls_a, calls_b = _calls(a), _calls(b)
    codes, _ = pd.factorize(pd.concat([calls_a["token"], calls_b["token"]], ignore_index=True))
    calls_a["code"], calls_b["code"] = codes[:len(calls_a)], codes[len(calls_a):]
    api_codes, _ = pd.factorize(pd.concat([calls_a["api"], calls_b["api"]], ignore_index=True))
    calls_a["api_code"], calls_b["api_code"] = api_codes[:len(calls_a)], api_codes[len(calls_a):]
    call_pairs = _pair_calls(calls_a, calls_b)

    ra = a[["step", "call", "role", "arg_index"]].assign(ia=np.arange(len(a)))
    ra = ra.merge(call_pairs, left_on=["step", "call"], right_on=["step", "call_a"], how="left")
    ra["call_b"] = ra["call_b"].fillna(-1).astype(np.int64)
    rb = b[["step", "call", "role", "arg_index"]].rename(columns={"call": "call_b"}).assign(ib=np.arange(len(b)))
    merged = ra.merge(rb, on=["step", "call_b", "role", "arg_index"], how="outer", sort=False)
    pairs = pd.DataFrame({
        "ia": merged["ia"].fillna(-1).astype(np.int64).to_numpy(),
        "ib": merged["ib"].fillna(-1).astype(np.int64).to_numpy(),
        "pairing": np.where(merged["label"].isna(), "", merged["label"].astype(object)),
    })
    paired = (pairs["ia"] >= 0) & (pairs["ib"] >= 0)
    pairs.loc[pairs["ib"] < 0, "pairing"] = "only_a"
    pairs.loc[pairs["ia"] < 0, "pairing"] = "only_b"
    ia, ib = pairs["ia"].to_numpy()[paired], pairs["ib"].to_numpy()[paired]
    shape_diff = a["shape"].to_numpy()[ia] != b["shape"].to_numpy()[ib]
    dtype_diff = a["dtype"].to_numpy()[ia] != b["dtype"].to_numpy()[ib]
    labels = pairs.loc[paired, "pairing"].to_numpy()
    labels = np.where(shape_diff, "shape_mismatch", np.where(dtype_diff, "dtype_mismatch", labels))
    pairs.loc[paired, "pairing"] = labels
    return pairs


def _calls(records: pd.DataFrame) -> pd.DataFrame:
    """One row per call: step, call, seq, name, module, api, direction, token, norms (tie-break)."""
    ordered = records.sort_values(["step", "call", "role", "arg_index"], kind="stable")
    step, call = ordered["step"].to_numpy(), ordered["call"].to_numpy()
    starts = np.flatnonzero(np.r_[True, (step[1:] != step[:-1]) | (call[1:] != call[:-1])]) if len(step) else \
        np.array([], np.int64)
    parts = (ordered["role"] + ":" + ordered["shape"] + ":" + ordered["dtype"] + "|").to_numpy(object)
    first = ordered.iloc[starts]
    calls = pd.DataFrame({c: first[c].to_numpy() for c in ("step", "call", "seq", "name", "module", "api",
                                                             "direction")})
    signature = np.add.reduceat(parts, starts) if len(starts) else np.array([], object)
    calls["token"] = calls["api"].to_numpy(object) + "|" + signature
    norms = np.empty(len(starts), object)
    norms[:] = np.split(ordered["norm"].to_numpy(np.float64), starts[1:]) if len(starts) else []
    calls["norms"] = norms
    return calls.sort_values(["step", "seq"], kind="stable").reset_index(drop=True)


def _pair_calls(calls_a: pd.DataFrame, calls_b: pd.DataFrame) -> pd.DataFrame:
    keys = ["step", "direction", "module"]
    groups_a = calls_a.groupby(keys, sort=False).indices
    groups_b = calls_b.groupby(keys, sort=False).indices
    col = {side: {c: df[c].to_numpy() for c in ("call", "name", "code", "api_code", "norms")}
           for side, df in (("a", calls_a), ("b", calls_b))}
    steps_a = calls_a["step"].to_numpy()
    out_step, out_a, out_b, out_label = [], [], [], []
    for key, idx_a in groups_a.items():
        idx_b = groups_b.get(key)
        if idx_b is None:
            continue
        names_a, names_b = col["a"]["name"][idx_a], col["b"]["name"][idx_b]
        if len(idx_a) == len(idx_b) and np.array_equal(names_a, names_b):
            pos_a, pos_b = np.arange(len(idx_a)), np.arange(len(idx_b))
        else:
            pos = align_sequences(col["a"]["code"][idx_a], col["b"]["code"][idx_b],
                                  col["a"]["api_code"][idx_a], col["b"]["api_code"][idx_b],
                                  col["a"]["norms"][idx_a], col["b"]["norms"][idx_b])
            pos_a, pos_b = (np.array(p, dtype=np.int64) for p in zip(*pos)) if pos else (np.array([], np.int64),) * 2
        ga, gb = idx_a[pos_a], idx_b[pos_b]
        out_step.append(steps_a[ga])
        out_a.append(col["a"]["call"][ga])
        out_b.append(col["b"]["call"][gb])
        out_label.append(np.where(col["a"]["name"][ga] == col["b"]["name"][gb], "matched", "realigned"))
    if not out_step:
        return pd.DataFrame({"step": np.array([], np.int64), "call_a": np.array([], np.int64),
                             "call_b": np.array([], np.int64), "label": np.array([], object)})
    return pd.DataFrame({"step": np.concatenate(out_step), "call_a": np.concatenate(out_a),
                         "call_b": np.concatenate(out_b), "label": np.concatenate(out_label)})


def align_sequences(tokens_a: Sequence[int], tokens_b: Sequence[int], apis_a: Sequence[int] = (),
                    apis_b: Sequence[int] = (), norms_a: Sequence = (), norms_b: Sequence = ()) -> list[tuple[int, int]]:
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
    """Pair a run of k equal-token calls with a run of l: in order when k == l, else the
    order-preserving choice of min(k, l) pairs with the closest tensor norms (dynamic programming)."""
    if count_a == count_b or not len(norms_a) or count_a * count_b > _MAX_RUN_DP:
        return [(i, i) for i in range(min(count_a, count_b))]
    swap = count_a > count_b
    short, long_ = (norms_b, norms_a) if swap else (norms_a, norms_b)
    k, l = len(short), len(long_)
    cost = np.array([[_distance(s, t) for t in long_] for s in short])
    # best[i, j]: least cost of pairing short[:i] within long_[:j]
    best = np.full((k + 1, l + 1), np.inf)
    best[0, :] = 0.0
    for i in range(1, k + 1):
        for j in range(i, l + 1):
            best[i, j] = min(best[i, j - 1], best[i - 1, j - 1] + cost[i - 1, j - 1])
    pairs, i, j = [], k, l
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
