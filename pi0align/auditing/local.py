"""Each call of a full-tensor dump against float64, alone: its local error (replayed from its own
inputs), held to its standard (standards.py) and to what the calls of its API introduce elsewhere
in the run; the culprits and their groups."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from pi0align.auditing.standards import FLOOR_UNITS, families, standards
from pi0align.compare.judging.execution import KIND_OF_DIRECTION, phases
from pi0align.compare.judging.groups import culprit_groups, family
from pi0align.compare.judging.judge import MIN_PEERS, STANDOUT, peer_medians
from pi0align.compare.judging.thresholds import UNIT_ROUNDOFF, dtype_class
from pi0align.compare.measuring.memory import HeapTrimmer
from pi0align.compare.measuring.replayed import RESULT_ROLES, RecordedCalls
from pi0align.compare.reading.records import Dump, user_frames
from pi0align.compare.result import Culprit, CulpritGroup
from pi0align.compare.table import Groups, Table

SYSTEMATIC_SHARE = 0.5  # most of an API's calls beyond their standard: its kernel, not one call


def local_errors(dump: Dump, advance: Callable[[], None] = lambda: None) -> tuple[Table, dict[str, int]]:
    """Per call of the dump that has results (forward, backward, the optimizer's updates), in
    execution order: its local error against float64, this CPU's kernel's on the same inputs, and
    its result dtype's unit roundoff; with why the calls not replayed were not (reason -> count)."""
    from pi0align.replay import replay

    records, recorded = dump.records, RecordedCalls(dump)
    keys = sorted({(int(s), str(d), int(c)) for s, d, c in zip(records["step"].tolist(), records["direction"].tolist(),
                                                                records["call"].tolist()) if d in RESULT_ROLES})
    rows, skipped, trim = [], {}, HeapTrimmer()
    for step, direction, call in keys:
        found = recorded.recorded(step, call, direction)
        result = found if isinstance(found, str) else replay(found, kernel=True)
        advance()
        if isinstance(result, str) or not result:
            reason = result if isinstance(result, str) else result.reason
            skipped[reason] = skipped.get(reason, 0) + 1
            continue
        own = recorded.records_of[(step, call)]
        results = [i for i in own if records["role"][i] == RESULT_ROLES[direction]]
        unit = max(UNIT_ROUNDOFF[dtype_class(records["dtype"][i])] for i in results)
        rows.append((int(records["rank"][own[0]]), step, direction, call, int(records["seq"][own[0]]),
                     str(records["name"][own[0]]), str(records["module"][own[0]]), str(records["api"][own[0]]),
                     unit, result.error, result.kernel_error))
        trim()
    columns = list(zip(*rows)) if rows else [()] * len(_CALL_COLUMNS)
    table = Table({name: np.array(column, dtype=kind) for (name, kind), column in zip(_CALL_COLUMNS.items(), columns)},
                  length=len(rows))
    return table.take(np.lexsort((table["seq"], phases(table["direction"]), table["step"]))), skipped


_CALL_COLUMNS = {"rank": np.int64, "step": np.int64, "direction": object, "call": np.int64, "seq": np.int64,
                 "name": object, "module": object, "api": object, "unit": np.float64, "error": np.float64,
                 "kernel_error": np.float64}


def judge_alone(calls: Table, dump: Dump, named: set[tuple] = frozenset()) -> tuple[list[Culprit], list[CulpritGroup]]:
    """The calls beyond their standard that stand out from their API's calls elsewhere (or whose
    API is off as a family), in execution order, and their groups; those `named` already (rank,
    step, direction, name: a NaN's origin) left out."""
    if not len(calls):
        return [], []
    family_of = families(calls["api"])
    limit, by_kernel = standards(calls["unit"], family_of, calls["kernel_error"])
    error = calls["error"].astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        beyond = error > limit
        blame = error / limit
    kind = np.array([KIND_OF_DIRECTION.get(d, "call") for d in calls["direction"].tolist()], object)
    api = Groups(calls["api"], calls["direction"])
    off = (api.count() >= MIN_PEERS) & (np.bincount(api.codes, beyond, len(api)) >= SYSTEMATIC_SHARE * api.count())
    culprit = beyond & (_stands_out(calls, error, api) | off[api.codes])
    culprit &= np.array([key not in named for key in zip(calls["rank"].tolist(), calls["step"].tolist(),
                                                           calls["direction"].tolist(), calls["name"].tolist())], bool)
    guilty = np.flatnonzero(culprit)
    culprits = [Culprit(step=int(calls["step"][i]), name=str(calls["name"][i]), module=str(calls["module"][i]),
                        api=str(calls["api"][i]), direction=str(calls["direction"][i]), rank=int(calls["rank"][i]),
                        stack=user_frames(dump.stacks.get((int(calls["step"][i]), int(calls["call"][i])), [])),
                        kind=str(kind[i]), introduced_error=float(blame[i]), output_error=float(error[i]),
                        metric="local_error", evidence="standard", local_error_a=float(error[i]),
                        bound=float(limit[i]), bound_by=_standard_text(float(calls["unit"][i]), str(family_of[i]),
                                                                       bool(by_kernel[i])))
                for i in guilty.tolist()]
    counts: dict[tuple[str, str], tuple[int, int]] = {}
    for key, is_beyond in zip(zip(kind.tolist(), (family(a, k) for a, k in zip(calls["api"].tolist(),
                                                                             kind.tolist()))), beyond.tolist()):
        total, beyond_count = counts.get(key, (0, 0))
        counts[key] = (total + 1, beyond_count + int(is_beyond))
    table = Table({"kind": kind[guilty], "api": calls["api"][guilty], "unit_a": calls["unit"][guilty].astype(float),
                   "unit_b": calls["unit"][guilty].astype(float), "output_error": error[guilty],
                   "name": calls["name"][guilty], "previous_step": np.full(len(guilty), -1, np.int64),
                   "step": calls["step"][guilty], "direction": calls["direction"][guilty]}, length=len(guilty))
    return culprits, culprit_groups(table, blame[guilty], counts, []) if len(guilty) else []


def _stands_out(calls: Table, error: np.ndarray, api: Groups) -> np.ndarray:
    """Local error ≥ STANDOUT × the median of its API's calls under other names (a faulty
    kernel is faulty at every step: the same call at another step is no peer), or too few peers."""
    typical, peers = peer_medians(error, api.codes, calls["name"])
    with np.errstate(invalid="ignore"):
        return (peers < MIN_PEERS) | ~(error < STANDOUT["rel_l2_err"] * typical)


_DTYPE_OF_UNIT = {unit: name for name, unit in UNIT_ROUNDOFF.items() if name != "integer"}


def _standard_text(unit: float, family_name: str, by_kernel: bool) -> str:
    """What a culprit's standard is made of."""
    if by_kernel:
        return "its standard: this CPU's own kernel's local error on the same inputs, × 2 (× 3 in half precision)"
    half = unit > UNIT_ROUNDOFF["float32"]
    return (f"its standard: {FLOOR_UNITS[family_name][int(half)]:g} u of {_DTYPE_OF_UNIT.get(unit, 'its dtype')} "
            f"({family_name} family)")
