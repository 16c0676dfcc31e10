"""Each side's local error per call, from the replay part (pi0align/replay, imported here only:
the one place a comparison imports torch), for dumps that hold full tensors.

For every paired forward or backward API call and optimizer update, each side's own recorded
inputs (and, backward, its own incoming gradients) are replayed in float64 on the CPU; the local error of each result is
written on its row (`local_error_a`, `local_error_b`), and why a call was not replayed in `replay`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from pi0align.compare.measuring.memory import HeapTrimmer
from pi0align.compare.measuring.metrics import TENSOR_METRICS, metrics_of_sums, tensor_sums
from pi0align.compare.reading.records import Dump
from pi0align.compare.table import Table, gather

RESULT_ROLES = {"forward": "output", "backward": "grad_input", "optimizer": "output"}
_CACHE_BYTES = 64 << 20  # decoded tensors kept per side: a call's inputs are mostly recent outputs


def measure_and_replay(rows: Table, a: Dump, b: Dump, ia: np.ndarray, ib: np.ndarray, judged: np.ndarray,
                       advance: Callable[[], None]) -> dict[str, np.ndarray]:
    """One pass over the paired calls, in execution order, each side's tensors of a call read once
    (and recent ones kept, for the calls that read them next): the tensor metrics of each row
    with full tensors on both sides (TENSOR_METRICS columns, NaN elsewhere), each side's local error
    of each result (local_error_a, local_error_b; NaN where not replayed), and why a call was not
    replayed (replay, "" where it was). `advance()` after each tensor pair and each call."""
    from pi0align.replay import replay

    n = len(rows)
    columns = {"local_error_a": np.full(n, np.nan), "local_error_b": np.full(n, np.nan),
               "replay": np.full(n, "", dtype=object), **{m: np.full(n, np.nan) for m in TENSOR_METRICS}}
    direction, role, steps = rows["direction"], rows["role"], rows["step"]
    paired = judged & (ia >= 0) & (ib >= 0)
    result_row = np.zeros(n, bool)
    for way, result_role in RESULT_ROLES.items():
        result_row |= (direction == way) & (role == result_role)
    tensor_a, tensor_b = (np.where(paired, gather(d.records["tensor"], index, ""), "")
                          for d, index in ((a, ia), (b, ib)))
    stored = paired & (tensor_a != "") & (tensor_b != "")
    sides = (RecordedCalls(a), RecordedCalls(b))
    calls_a, calls_b = gather(a.records["call"], ia, -1), gather(b.records["call"], ib, -1)
    groups: dict[tuple, list[int]] = {}
    for row in np.flatnonzero(stored | (paired & result_row)).tolist():
        groups.setdefault((int(steps[row]), int(calls_a[row]), int(calls_b[row]), str(direction[row])), []).append(row)
    trim = HeapTrimmer()
    measured, sums = [], []  # rows with tensors on both sides, and their error sums
    for (step, call_a, call_b, way), members in sorted(groups.items()):
        for row in (r for r in members if stored[r]):
            sums.append(tensor_sums(*(side.array(int(index[row])) for side, index in zip(sides, (ia, ib)))))
            measured.append(row)
            advance()
        results = [r for r in members if result_row[r]]
        if results and way in RESULT_ROLES:
            replayed = []
            for side, call in zip(sides, (call_a, call_b)):
                recorded = side.recorded(step, call, way)
                replayed.append(recorded if isinstance(recorded, str) else replay(recorded))
            reasons = [r if isinstance(r, str) else r.reason for r in replayed]
            for row in results:
                k = int(rows["arg_index"][row])
                for column, result in zip(("local_error_a", "local_error_b"), replayed):
                    if not isinstance(result, str) and result:
                        columns[column][row] = result.errors.get(k, np.nan)
                columns["replay"][row] = _why_not(*reasons)
            advance()
        trim()
    if measured:
        for metric, values in metrics_of_sums(np.array(sums)).items():
            columns[metric][measured] = values
    return columns


def _why_not(reason_a: str, reason_b: str) -> str:
    if reason_a == reason_b:
        return reason_a
    return "; ".join(f"{side}: {reason}" for side, reason in (("A", reason_a), ("B", reason_b)) if reason)


class RecordedCalls:
    """One dump's records by call, and the tensors of a call read as numpy arrays."""

    def __init__(self, dump: Dump):
        self.dump = dump
        records = dump.records
        self.steps, self.calls = records["step"].astype(np.int64), records["call"].astype(np.int64)
        self.records_of: dict[tuple[int, int], list[int]] = {}
        for i, key in enumerate(zip(self.steps.tolist(), self.calls.tolist())):
            self.records_of.setdefault(key, []).append(i)
        self.forward_of: dict[tuple[int, str], int] = {}
        for i in np.flatnonzero(records.isin("direction", "forward")).tolist():
            self.forward_of.setdefault((int(self.steps[i]), str(records["name"][i])), int(self.calls[i]))
        self.cache: OrderedDict[tuple[int, str], np.ndarray] = OrderedDict()
        self.cached_bytes = 0

    def find(self, name: str, step: int | None, direction: str) -> tuple[int, int] | None:
        """(step, call) of the call named `name` in `direction`, at `step` or the first step that has it."""
        records = self.dump.records
        found = np.flatnonzero((records["name"] == name) & (records["direction"] == direction)
                               & ((self.steps == step) if step is not None else True))
        if not len(found):
            return None
        first = found[np.argmin(self.steps[found])]
        return int(self.steps[first]), int(self.calls[first])

    def recorded(self, step: int, call: int, direction: str):
        """The RecordedCall of this side's call, or why there is none (a str)."""
        from pi0align.replay import RecordedCall

        if self.dump.args_reader is None:
            return "arguments not recorded (not a pi0align dump)"
        records = self.dump.records
        own = self.records_of.get((step, call), [])
        first = own[0]
        forward = call if direction != "backward" else self.forward_of.get((step, str(records["name"][first])))
        if forward is None:
            return "forward call not dumped"
        try:
            inputs = self._tensors(step, forward, "input")
            results = self._tensors(step, call, RESULT_ROLES[direction])
            grad_outputs = self._tensors(step, call, "grad_output") if direction == "backward" else None
        except LookupError as why:
            return str(why)
        dtypes = {int(records["arg_index"][i]): str(records["dtype"][i])
                  for i in self.records_of.get((step, forward), []) if records["role"][i] == "input"}
        return RecordedCall(api=str(records["api"][first]), args=self.dump.args_reader(step, forward),
                            inputs=inputs, results=results, grad_outputs=grad_outputs, dtypes=dtypes)

    def _tensors(self, step: int, call: int, role: str) -> dict[int, np.ndarray]:
        records = self.dump.records
        found = {}
        for i in self.records_of.get((step, call), []):
            if records["role"][i] != role:
                continue
            if not records["tensor"][i]:
                raise LookupError(f"{role} {int(records['arg_index'][i])} not dumped in full")
            found[int(records["arg_index"][i])] = self.array(i)
        return found

    def array(self, record: int) -> np.ndarray:
        """The full tensor of one of this dump's records, decoded (kept while recent)."""
        key = (int(self.steps[record]), str(self.dump.records["tensor"][record]))
        if key in self.cache:
            self.cache.move_to_end(key)
            return self.cache[key]
        array = np.asarray(self.dump.tensor(record)[()])
        self.cache[key] = array
        self.cached_bytes += array.nbytes
        while self.cached_bytes > _CACHE_BYTES and len(self.cache) > 1:
            _, dropped = self.cache.popitem(last=False)
            self.cached_bytes -= dropped.nbytes
        return array
