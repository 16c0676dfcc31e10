"""What no dumped call computed: the arithmetic inside a module between its dumped calls, and the
batch where no data record holds it (msprobe's dumps; ours with the batch filtered out).
"""

from __future__ import annotations

import numpy as np

from pi0align.compare.judging.calltable.bounds import (
    half_precision,
    numels,
    rounding_floor,
)
from pi0align.compare.judging.calltable.channels import channel_ratios
from pi0align.compare.judging.identity import requires_grad
from pi0align.compare.judging.modules import holds_calls
from pi0align.compare.table import Table, gather, key_codes, lookup


def add_inside_errors(calls: Table, rows: Table, call_of_row: np.ndarray, producer: np.ndarray,
                       parent: np.ndarray, identity: np.ndarray, channels: Table, failing: np.ndarray) -> None:
    """What a module holding calls computed that no dumped call did: the forward inputs of the
    calls inside it that no dumped call, parameter or batch produced (an operation filtered out,
    one of `torch.ops`, an extension kernel, calls on one side only, at level module the arithmetic
    between its children), and its output where no call inside it produced that. Each such result
    is held, channel by channel (`channel_ratios`), to what it could have read: the module's inputs
    and parameters and the outputs of its calls before it, through C = 1 (an API whose condition is
    not known), or its rounding. `inside_error`: the largest such result's error; the module's
    introduced error (`inside_introduced`, and the bound of its largest, `inside_bound`) the
    largest over them. Its calls are judged on their own. `call_of_row`: each row's call (-1:
    none); `producer`: the row that produced each row's tensor (identity.produced); `parent`:
    modules.enclosing_modules; `channels`: per row, its error, its errors as a source (`source`,
    `summed_source`: elementwise_errors) and statistic_channels (`summed`, `extremes`, `spread`)."""
    n = len(calls)
    for column in ("inside_error", "inside_introduced", "inside_bound"):
        calls[column] = np.zeros(n)
    calls["with_calls_inside"] = holds_calls(calls, parent)
    if not (parent >= 0).any():
        return
    in_table = call_of_row >= 0
    forward = rows.isin("direction", "forward")
    seq = rows["seq_a"].astype(np.float64)

    def enclosing(call: int):
        module = parent[call]
        while module >= 0:
            yield module
            module = parent[module]

    outputs = np.flatnonzero(forward & rows.isin("role", "output") & in_table)
    made_inside: dict[int, set] = {}  # module call -> identities its calls' outputs hold
    read_inside: dict[int, list[int]] = {}  # module call -> its calls' output rows
    last_inside = np.full(n, np.nan)  # per module call, the sequence number of its last call
    for row in outputs.tolist():
        for module in enclosing(call_of_row[row]):
            made_inside.setdefault(module, set()).add(int(identity[row]))
            read_inside.setdefault(module, []).append(row)
            last_inside[module] = np.fmax(last_inside[module], seq[row])
    # when each output was made: a module's after its last call
    module_end = gather(last_inside, call_of_row, np.nan)
    made_at = np.where(np.isnan(module_end), seq, module_end + 0.5)
    undumped = [(module, row) for row in
                np.flatnonzero(forward & rows.isin("role", "input") & in_table & failing & (producer < 0)).tolist()
                for module in enclosing(call_of_row[row])]
    undumped += [(call_of_row[row], row) for row in outputs[failing[outputs]].tolist()
                 if calls["with_calls_inside"][call_of_row[row]]
                 and (identity[row] < 0 or int(identity[row]) not in made_inside.get(call_of_row[row], set()))]
    if not undumped:
        return
    module, row = (np.array(column, np.int64) for column in zip(*undumped))
    source, summed_source, spread = _what_each_could_read(calls, rows, module, row, read_inside, made_at, channels)
    unit = calls["unit"][module].astype(np.float64)
    one = np.ones(len(row))
    floor = rounding_floor(unit, one, np.full(len(row), "", object), calls["api"][module])
    ratio = channel_ratios(channels["summed"][row], channels["extremes"][row], numels(rows["shape_a"][row]),
                           np.nan_to_num(source), np.nan_to_num(summed_source),
                           np.where(half_precision(unit), np.nan_to_num(spread), 0.0), one, one, floor)
    error = channels["error"][row]
    with np.errstate(divide="ignore", invalid="ignore"):
        bound = np.where(ratio > 0, error / ratio, floor)
    for i, m in enumerate(module.tolist()):
        calls["inside_error"][m] = max(calls["inside_error"][m], np.nan_to_num(error[i]))
        if np.nan_to_num(ratio[i], nan=-np.inf) > calls["inside_introduced"][m]:
            calls["inside_introduced"][m], calls["inside_bound"][m] = ratio[i], bound[i]



def _what_each_could_read(calls: Table, rows: Table, module: np.ndarray, row: np.ndarray,
                          read_inside: dict[int, list[int]], made_at: np.ndarray,
                          channels: Table) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(source, summed_source, spread) of what each result `row` computed inside `module` (module
    calls) could have read: the module's inputs, and its calls' outputs made before it (its own
    module's output: all of them), by the running largest of each channel in their order.
    `read_inside`: each module call's calls' output rows; `made_at`: when each row was made."""
    inputs = {"source": "input_error", "summed_source": "input_summed", "spread": "input_spread"}
    read = {kind: np.array(calls[column][module], np.float64) for kind, column in inputs.items()}
    seq = rows["seq_a"].astype(np.float64)
    running: dict[int, tuple] = {}
    for i, (m, r) in enumerate(zip(module.tolist(), row.tolist())):
        if m not in running:
            inner = np.array(read_inside.get(m, []), np.int64)
            inner = inner[np.argsort(made_at[inner], kind="stable")]
            running[m] = (made_at[inner], {kind: np.maximum.accumulate(np.nan_to_num(channels[kind][inner]))
                                       for kind in inputs})
        order, largest = running[m]
        before = len(order) if rows["role"][r] == "output" else int(np.searchsorted(order, seq[r]))
        if before:
            for kind in inputs:
                read[kind][i] = max(np.nan_to_num(read[kind][i]), largest[kind][before - 1])
    return read["source"], read["summed_source"], read["spread"]


def model_input_rows(calls: Table, rows: Table, call_of_row: np.ndarray, producer: np.ndarray, parent: np.ndarray,
                  identity: np.ndarray) -> np.ndarray:
    """Where a step has no data records (msprobe's dumps; ours with the batch filtered out), the
    rows that stand for the batch: forward inputs that no dumped call, parameter or batch record
    produced, that require no gradient where the dump says (msprobe's do: weights and activations
    do), else read by calls that no module holds; of each such tensor, its first reader's row."""
    data = calls.isin("direction", "data")
    grad = requires_grad(rows)
    read = rows.isin("direction", "forward") & rows.isin("role", "input") & (call_of_row >= 0) & (producer < 0)
    read &= np.where(grad >= 0, grad == 0, gather(parent, call_of_row, 0) < 0)
    read &= lookup([rows["rank"], rows["step"]], [calls["rank"][data], calls["step"][data]]) < 0
    first = np.zeros(len(rows), bool)
    candidates = np.flatnonzero(read)
    order = candidates[np.lexsort((rows["seq_a"][candidates].astype(np.float64), rows["step"][candidates],
                                   rows["rank"][candidates]))]
    known = identity[order] >= 0
    first[order[~known]] = True  # a tensor not known: each reading its own
    kept = order[known]
    tensor, _ = key_codes(rows["rank"][kept], rows["step"][kept], identity[kept])
    first[kept[np.unique(tensor, return_index=True)[1]]] = True  # each tensor's first reader
    return first


def batch_stand_ins(calls: Table, rows: Table, call_of_row: np.ndarray, model_inputs: np.ndarray,
                     error: np.ndarray, failing: np.ndarray, metric: np.ndarray) -> Table:
    """One data call per failing row of the model's inputs (`model_input_rows`), named after the call
    that read it (`<call>/input <k>`), at that call's place."""
    rows_of = np.flatnonzero(model_inputs & failing).tolist()
    stand_ins = calls.take(call_of_row[rows_of])
    n = len(rows_of)
    stand_ins["direction"] = np.full(n, "data", object)
    stand_ins["api"] = np.full(n, "Data", object)
    stand_ins["name"] = np.array([f"{rows['name'][r]}/input {rows['arg_index'][r]}" for r in rows_of], object)
    stand_ins["output_error"], stand_ins["metric"] = error[rows_of], metric[rows_of]
    stand_ins["output_summed"] = error[rows_of]  # its whole error: nothing it was handed explains it
    for column, value in (("input_error", 0.0), ("input_summed", 0.0), ("input_spread", 0.0),
                          ("output_spread", 0.0), ("inputs_fail", False), ("outputs_fail", True),
                          ("inputs_identical", True), ("outputs_differ", True), ("args_differ", False),
                          ("inside_error", 0.0), ("inside_introduced", 0.0), ("inside_bound", 0.0),
                          ("with_calls_inside", False), ("condition", 1.0),
                          ("condition_rule", ""), ("condition_extremes", np.nan), ("invariant_error", 0.0),
                          ("local_error_a", np.nan), ("local_error_b", np.nan), ("replay", "")):
        stand_ins[column] = np.full(n, value, dtype=object if isinstance(value, str) else None)
    return stand_ins
