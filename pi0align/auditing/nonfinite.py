"""Where a run's first NaN or Inf came from, from one dump alone (any mode, any rank, ours and
msprobe's): the first call in execution order whose results hold NaN or Inf while what it was
handed holds none; and results that a few doublings would take past their dtype's largest value.

msprobe's `overflow_check` is the anchor: it stops at the first API whose output overflows. Here
every record says whether it holds NaN or Inf (our dumps count them; msprobe's statistics show it:
a NaN makes the minimum and maximum NaN, an Inf one of them infinite), so the whole run is read
at once and the origin named with its kind: the batch (`data`), the optimizer's update
(`optimizer`), a parameter's gradient beyond its backward calls (`gradient`), or a call.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pi0align.compare.judging.execution import KIND_OF_DIRECTION, call_directions, phases
from pi0align.compare.judging.modules import is_module_api
from pi0align.compare.reading.records import INPUT_ROLES, OUTPUT_ROLES, Dump, function_names, user_frames
from pi0align.compare.result import Culprit
from pi0align.compare.table import Groups, Table, isin

# The largest finite value of each floating dtype a dump names.
DTYPE_MAX = {"float64": 1.7976931348623157e308, "float32": 3.4028234663852886e38, "float16": 65504.0,
             "bfloat16": 3.3895313892515355e38}
# A result this close to its dtype's largest value is four doublings (or a square of a quarter of
# it) from overflowing: said before it becomes Inf.
EDGE = 1 / 16
# Calls that place a value rather than compute it (a mask's fill, a constant): their results at
# the edge are on purpose (PI0's attention masks hold -2.38e38).
PLACING = frozenset({"where", "masked_fill", "masked_fill_", "full", "full_like", "new_full", "fill", "fill_",
                     "tensor", "as_tensor", "scalar_tensor", "clamp", "clamp_", "clip", "clip_", "finfo"})
RESULT_ROLES = (*OUTPUT_ROLES, "parameter", "parameter_grad")


@dataclass(frozen=True)
class EdgeValue:
    """A result whose largest magnitude came within EDGE of its dtype's largest value while what
    its call was handed stayed below: where an overflow would start."""

    step: int
    rank: int
    name: str
    api: str
    direction: str
    dtype: str
    value: float  # the result's largest magnitude
    limit: float  # its dtype's largest finite value


def nonfinite_records(records: Table) -> tuple[np.ndarray, np.ndarray]:
    """(holds NaN, holds Inf) per record: its counts where the dump has them (ours), else its
    statistics (msprobe's: a NaN makes the minimum and maximum NaN, an Inf one of them infinite;
    the mean and norm may overflow where no element does)."""
    low, high = records["min"].astype(np.float64), records["max"].astype(np.float64)
    nan_count, inf_count = records["nan_count"].astype(np.float64), records["inf_count"].astype(np.float64)
    nan = np.where(np.isnan(nan_count), np.isnan(low) | np.isnan(high), nan_count > 0)
    inf = np.where(np.isnan(inf_count), np.isinf(low) | np.isinf(high), inf_count > 0)
    return nan, inf


def nonfinite_origins(dump: Dump) -> list[Culprit]:
    """The first call of each rank whose results hold NaN or Inf while its inputs hold none, in
    execution order (an API call before the module holding it); where none is (the batch of a
    dump without Data records holds them), the first input that does, as data. Empty when every
    record is finite."""
    records = dump.records
    nan, inf = nonfinite_records(records)
    bad = nan | inf
    if not bad.any():
        return []
    direction = call_directions(records).values
    calls = Groups(records["rank"], records["step"], direction, records["call"])
    bad_in = calls.any(bad & isin(records["role"], INPUT_ROLES))
    bad_out = calls.any(bad & isin(records["role"], RESULT_ROLES))
    first = calls.first
    module = is_module_api(records["api"][first])
    order = np.lexsort((records["seq"][first].astype(np.float64), module, phases(direction[first]),
                        records["step"][first]))
    origins = []
    for rank in np.unique(records["rank"][first]).tolist():
        mine = order[(records["rank"][first][order] == rank)]
        found = mine[bad_out[mine] & ~bad_in[mine]]
        if len(found):
            origins.append(_origin(dump, records, calls, first[found[0]], direction, nan, inf, bad_out=True))
        elif bad_in[mine].any():
            origins.append(_origin(dump, records, calls, first[mine[bad_in[mine]][0]], direction, nan, inf,
                                   bad_out=False))
    return sorted(origins, key=lambda c: (c.step, c.rank))


def _origin(dump: Dump, records: Table, calls: Groups, row: int, direction: np.ndarray, nan: np.ndarray,
            inf: np.ndarray, bad_out: bool) -> Culprit:
    """The origin at record `row` (its call's first): its results hold NaN/Inf and its inputs none
    (`bad_out`), or, where no call made them, the input that first holds them (kind `data`)."""
    own = calls.codes == calls.codes[row]
    roles = RESULT_ROLES if bad_out else INPUT_ROLES
    held = own & isin(records["role"], roles)
    which = "results" if bad_out else "inputs"
    counts = ", ".join(f"{what} in {int(np.sum(held & flag))} of its {which}"
                       for what, flag in (("NaN", nan), ("Inf", inf)) if (held & flag).any())
    step, call = int(records["step"][row]), int(records["call"][row])
    way = str(direction[row])
    if bad_out:
        kind = KIND_OF_DIRECTION.get(way, "call")
        if way == "parameter":  # what an update (or, at the first dumped step, the run before it) made
            first_step = int(records["step"].min())
            kind = "initial_weights" if step == first_step == 0 else "parameters" if step == first_step else "optimizer"
        why = (f"the batch holds it: {counts}, read, not computed" if kind == "data"
               else f"{counts} while what it was handed holds none")
    else:
        kind, why = "data", f"{counts}, which no dumped call made: the model's input, or an operation not dumped"
    name = str(records["name"][row])
    if not bad_out:  # the input that holds them stands for the batch, as compare's stand-ins do
        name += f"/input {int(records['arg_index'][np.flatnonzero(held & (nan | inf))[0]])}"
    return Culprit(step=step, name=name, module=str(records["module"][row]), api=str(records["api"][row]),
                   direction=way, stack=user_frames(dump.stacks.get((step, call), [])), rank=int(records["rank"][row]),
                   kind=kind, evidence="nonfinite", bound_by=why)


def edge_values(dump: Dump) -> list[EdgeValue]:
    """The results, in execution order, whose largest finite magnitude is at least EDGE of their
    dtype's largest value while every input of their call stays below it, leaving out calls that
    place values (PLACING), integers, and modules where API calls are dumped."""
    records = dump.records
    dtype = records["dtype"].astype(str)
    largest = np.fmax(np.abs(records["min"].astype(np.float64)), np.abs(records["max"].astype(np.float64)))
    limit = np.array([DTYPE_MAX.get(d, np.inf) for d in dtype.tolist()])
    with np.errstate(invalid="ignore"):
        near = np.isfinite(largest) & (largest >= EDGE * limit)
    if not near.any():
        return []
    direction = call_directions(records).values
    calls = Groups(records["rank"], records["step"], direction, records["call"])
    inputs_near = calls.any(near & isin(records["role"], INPUT_ROLES))[calls.codes]
    new = near & isin(records["role"], RESULT_ROLES) & ~inputs_near
    new &= ~np.isin(function_names(records["api"]), list(PLACING))
    module = is_module_api(records["api"])
    if (new & ~module).any():  # a module's result is one of the calls' inside it, which say where it was made
        new &= ~module
    rows = np.flatnonzero(new)
    rows = rows[np.lexsort((records["seq"][rows].astype(np.float64), phases(direction[rows]), records["step"][rows]))]
    return [EdgeValue(step=int(records["step"][r]), rank=int(records["rank"][r]), name=str(records["name"][r]),
                      api=str(records["api"][r]), direction=str(direction[r]), dtype=str(dtype[r]),
                      value=float(largest[r]), limit=float(limit[r])) for r in rows.tolist()]
