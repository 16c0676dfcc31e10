"""The standard a call's local error is held to when a run is judged alone (docs/audit.md).

A call's local error is the relative L2 distance of its recorded results to the same call replayed
in float64 from its own recorded inputs (pi0align/replay): the error its kernel added to what it
was handed. Alone, there is no other device's kernel to hold it to, so it is held to:

* an absolute floor per dtype and API family, F × u (u the unit roundoff of the result's dtype):
  what rounding once, or a reduction's accumulation, puts on a result. msprobe's accuracy
  standards (api_precision_compare) are the reference: its absolute-threshold APIs (add, mul, div,
  rsqrt, ...) allow a relative error of 2⁻²⁰ = 16 u in float32 and 2⁻⁸ (bfloat16) or 2⁻¹⁰ (float16)
  element by element; its ULP standard for the matmul family a mean of 64 ulps in float32;
* raised to R × the local error of this CPU's own kernel, in the recorded dtypes, on the same
  inputs (`replay(kernel=True)`): what a sound kernel's rounding puts on those very inputs, a long
  sum or terms that cancel included. R is torch dynamo's `same()` multiplier (2, 3 in half
  precision), as compare's replay uses for two devices' kernels.

A call beyond its standard is a culprit where it also stands out from what the calls of its API
introduce elsewhere in the same run (judge.STANDOUT × their median), or where its API is off as a
family (most of its calls beyond: every matmul of an fp32 run on TF32 inputs).
"""

from __future__ import annotations

import numpy as np

from pi0align.compare.judging.groups import MATMUL_FAMILY
from pi0align.compare.judging.judge import replay_ratio_limit
from pi0align.compare.judging.thresholds import UNIT_ROUNDOFF
from pi0align.compare.reading.records import function_names
from pi0align.dump.file_format import OPTIMIZER_API

# F, in unit roundoffs of the result's dtype, per API family: (float32 and float64, half precision).
# float32: msprobe's 2⁻²⁰ = 16 u for elementwise APIs, 64 ulps for its matmul family; half
# precision: 3 u, above a result's rounding (≈ 0.4 u) and a fused kernel's few roundings, below a
# 2 % fault (5.1 u in bf16). An optimizer's update rounds each state twice (bounds.UPDATE_ROUNDINGS).
FLOOR_UNITS = {"elementwise": (16.0, 3.0), "matmul": (64.0, 3.0), "optimizer": (32.0, 6.0)}
FAMILIES = tuple(FLOOR_UNITS)


def families(apis: np.ndarray) -> np.ndarray:
    """Each API's family: the matmul family (what TF32 and HF32 change), the optimizer's update,
    or elementwise (every other call: its kernel's own rounding, as a reduction's, is what this
    CPU's kernel shows on the same inputs)."""
    names = function_names(apis)
    return np.where(np.asarray(apis, object) == OPTIMIZER_API, "optimizer",
                    np.where(np.isin(names, list(MATMUL_FAMILY)), "matmul", "elementwise")).astype(object)


def standards(unit: np.ndarray, family: np.ndarray, kernel_error: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the local error each call is held to, whether this CPU's kernel set it rather than the
    floor) from its result's unit roundoff, its family and this CPU's kernel's local error (NaN
    where that kernel could not run)."""
    unit = np.asarray(unit, np.float64)
    half = unit > UNIT_ROUNDOFF["float32"]
    floor = unit * np.array([FLOOR_UNITS[f][int(h)] for f, h in zip(family.tolist(), half.tolist())])
    kernel = replay_ratio_limit(unit) * np.nan_to_num(np.asarray(kernel_error, np.float64), nan=0.0)
    return np.maximum(floor, kernel), kernel > floor
