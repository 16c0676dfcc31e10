"""Gradients at rounding level.

Some gradients are zero in exact arithmetic and pure rounding noise in floating point -- the
bias of attention keys is the classic case (softmax ignores a constant shift). Two runs then
disagree completely on them although neither is wrong. Such records are judged `warn`, never
`fail`, and named in a note: they cannot indicate a faulty kernel. What Adam makes of them (updates
of the size of the learning rate) is judged by the update's bound, not here.

A gradient is at rounding level when, on both sides, its norm is below ROUNDING_UNITS unit
roundoffs of the largest gradient of its context (the other gradients of the same backward call;
for a parameter gradient, the other parameter gradients of the module): rounding noise of a sum of
K terms of that size grows as √K u, so 64 u covers sums over up to 4096 terms in float32. In half
precision one unit roundoff, the dtype's own limit: a gradient that vanishes beside the largest.
"""

from __future__ import annotations

import numpy as np

from pi0align.compare.judging.thresholds import UNIT_ROUNDOFF
from pi0align.compare.table import Groups, Table, isin, mapped

_GRADIENT_ROLES = ("grad_input", "grad_output")
ROUNDING_UNITS = {"float64": 64.0, "float32": 64.0, "float16": 1.0, "bfloat16": 1.0, "integer": 0.0}


def rounding_share(classes: np.ndarray) -> np.ndarray:
    """Per record (its `dtype_class`), the share of its context's largest gradient below which a
    gradient is rounding noise."""
    return mapped(classes, lambda c: ROUNDING_UNITS[c] * UNIT_ROUNDOFF[c] if c else 0.0, np.float64)


def rounding_level(rows: Table, verdict: np.ndarray) -> np.ndarray:
    """Mask of failing gradient records at rounding level."""
    role, rank, step = rows["role"], rows["rank"], rows["step"]
    backward = rows.isin("direction", "backward") & isin(role, _GRADIENT_ROLES)
    parameter_grad = role == "parameter_grad"
    norm_a = rows["norm_a"].astype(np.float64)
    reference = np.zeros(len(rows))
    for mask, context in ((backward, rows["seq_a"]), (parameter_grad, rows["module"])):
        groups = Groups(rank[mask], step[mask], context[mask])
        reference[mask] = groups.max(np.where(np.isnan(norm_a[mask]), 0.0, norm_a[mask]))[groups.codes]
    floor = rounding_share(rows.coded("dtype_class")) * reference
    with np.errstate(invalid="ignore"):
        tiny = (norm_a < floor) & (rows["norm_b"].astype(np.float64) < floor)
    return tiny & (backward | parameter_grad) & (role != "grad_output") & (verdict == "fail")


def rounding_notes(count: int, names: set[str]) -> list[str]:
    """A note naming the `count` failing gradients at rounding level (`rounding_level`), of these names."""
    if not count:
        return []
    names = sorted(names)
    return [f"{count} failing gradients are at rounding level (zero in exact arithmetic); judged warn: "
            f"{', '.join(names[:3])}" + (f" and {len(names) - 3} more" if len(names) > 3 else "")]
