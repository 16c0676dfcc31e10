"""How much output error a call's inputs and its own rounding explain (docs/compare.md, "Bounds").

A call is within its bound when its output error e_out is at most MARGIN × max(C × e_in, F × u × S):
e_in the largest error among its inputs, C the condition of its API (how much the API itself
grows a relative error, from the records' statistics: `conditions`, one table for every API; 1
where it does not), u the unit roundoff of its output dtype, F the unit roundoffs its own
rounding and the other side's may put on it, and S = C for calls that sum (their terms' rounding
cancels as their values do; 1 for the others). A statistic that a result keeps whatever its
inputs (a softmax's mean: every row sums to one) is held to the floor alone (`invariant_error`).
`introduced` is e_out over that bound: above MARGIN, the call adds error that neither its inputs
nor rounding explain, whatever its inputs hold.

The floor F × u, per statistic: one ulp (F = 2) in half precision. Each side rounds its result
once from a wider accumulator, within half an ulp of the exact value, so the two sides are at
most an ulp apart in each element (an ulp is u to 2 u of the element), and so in each statistic:
the extremes (relative to the largest magnitude), the norm (by the triangle inequality) and the
mean (relative to the RMS: |Δ mean| ≤ mean |δ_i| ≤ 2 u RMS); the same holds for the relative L2
error of full tensors. Eight ulps (F = 16) in float32 and float64: device libraries' transcendental
functions are within one to four ulps on each side (CUDA's expf and tanhf: two), and reductions
reorder sums of K terms (≈ √K u).
"""

from __future__ import annotations

import functools
import json
import math

import numpy as np

from pi0align.compare.judging.modules import is_module_api
from pi0align.compare.judging.thresholds import UNIT_ROUNDOFF
from pi0align.compare.measuring.arguments import adam_step_for
from pi0align.compare.reading.records import function_name, subjects
from pi0align.compare.table import Coded, KeyIndex, Table, isin, lookup, mapped, recoded
from pi0align.dump.file_format import OPTIMIZER_API

# An output error up to twice what the inputs and rounding explain is the spread of the measure
# itself (statistics see a tensor's extremes and sums, not its elements); a 3 % fault on an
# input already 0.5 % off introduces 6×.
MARGIN = 2.0
# F, the error rounding alone may put on a result, in unit roundoffs u (docs/compare.md, Bounds):
# in half precision each side rounds its result once from a wider accumulator, so the sides are at
# most an ulp (2 u) apart in any element; in float32 and float64 the accumulation itself rounds,
# in another order on each side: eight ulps.
FLOOR_UNITS_HALF, FLOOR_UNITS = 2.0, 16.0

# The conditions of APIs, by function name (what follows the last dot of the API); the
# derivations are in docs/compare.md, "Bounds". APIs that sum products over a reduction dimension
# (their operands' input indexes): C = ‖A‖ ‖B‖ / (√K ‖AB‖)
MATMULS = {"linear": (0, 1), "matmul": (0, 1), "__matmul__": (0, 1), "mm": (0, 1), "bmm": (0, 1), "mv": (0, 1),
           "addmm": (1, 2), "baddbmm": (1, 2)}
# products: the factors' relative errors add, C = 2 where two tensors are multiplied
MULTIPLICATIONS = frozenset({"mul", "__mul__", "__rmul__", "__imul__", "mul_", "multiply"})
PRODUCTS = MULTIPLICATIONS | {"addcmul", "addcmul_"}
# where one factor is constant along the other's rows (its last dimension 1: a per-row scale, as
# RMSNorm's x * rsqrt(mean(x²) + eps)), the rows' own errors bound the product's, whatever scale
# each row gets: ‖δ(a s)‖ ≤ (ρ_a + ρ_s) ‖a s‖, ρ a factor's largest relative L2 error of a row
# (full tensors only: `_row_scaled_product_conditions`)
# quotients and roots: (the input near zero, C from its R = max|x| / min|x|): an error of e max|x|
# is e R relative at the element closest to zero (R infinite where x reaches zero)
QUOTIENTS = {**dict.fromkeys(("div", "__truediv__", "__itruediv__", "div_", "true_divide", "divide"),
                             (1, lambda r: 1.0 + r)),
             "__rtruediv__": (0, lambda r: 1.0 + r), "addcdiv": (2, lambda r: 1.0 + r),
             "addcdiv_": (2, lambda r: 1.0 + r), "reciprocal": (0, lambda r: r), "reciprocal_": (0, lambda r: r),
             "rsqrt": (0, lambda r: r / 2), "rsqrt_": (0, lambda r: r / 2),
             "sqrt": (0, lambda r: np.sqrt(r) / 2), "sqrt_": (0, lambda r: np.sqrt(r) / 2)}
# their gradients where they are powers x^p: g ⊙ p x^(p-1), a product whose factor x^(p-1) errs by
# |p - 1| e R at the element closest to zero, so C = 1 + |p - 1| R (R of the forward call's input)
POWER_GRADIENTS = {**dict.fromkeys(("rsqrt", "rsqrt_"), -0.5), **dict.fromkeys(("sqrt", "sqrt_"), 0.5),
                   **dict.fromkeys(("reciprocal", "reciprocal_"), -1.0)}
# sums and differences: C = Σ ‖inputs‖ / ‖output‖ (cancellation, by the triangle inequality)
ADDITIONS = frozenset({"add", "__add__", "__radd__", "__iadd__", "add_", "sub", "__sub__", "__rsub__", "__isub__",
                       "sub_", "subtract", "lerp", "lerp_"})
# powers: C = 2, the square (the exponent is not read from the records; with MARGIN, up to the fourth)
POWERS = frozenset({"pow", "pow_", "__pow__", "square", "square_"})
# exp: an absolute input error is the output's relative error, C = max|x|
EXPONENTIALS = frozenset({"exp", "exp_", "exp2", "exp2_"})
# softmax: δp/p = δz − Σ p δz, so C = 2 max|z|; its mean is 1 / (row length) whatever its input.
# Its gradient, dz = p ⊙ (g − Σ p g), cancels: C = 2 max p ‖g‖ / ‖dz‖ (`_softmax_gradient_conditions`)
SOFTMAXES = frozenset({"softmax", "_softmax"})
# log_softmax: δ out = δz − Σ p δz, C = 2 max|z| / max|out|
LOG_SOFTMAXES = frozenset({"log_softmax", "_log_softmax"})
# normalisations over a dimension: C = RMS(x) / std(x) = ‖x‖ / √(‖x‖² − n mean²)
NORMALIZATIONS = frozenset({"layer_norm", "group_norm", "batch_norm", "instance_norm", "native_layer_norm"})
# forward reductions to fewer elements (their result's scaling: a sum, or a mean over P terms)
REDUCTIONS = {"sum": "sum", "nansum": "sum", "mean": "mean", "nanmean": "mean"}
# calls whose own rounding is amplified by their condition: sums whose terms cancel
SUMMING_RULES = frozenset({"matmul", "reduction", "gradient sum", "softmax gradient"})
# an optimizer's update rounds each state twice in its dtype (the parameter decayed, then stepped;
# the second moment scaled, then added to; a fused kernel once): bf16 ulp noise on every operation
# put 3.5 u on a bias's update, against 0.4 u for the same update without it
UPDATE_ROUNDINGS = 2.0


def matmul_name(api: str) -> str:
    """An API's function name in lower case, by which a module of the matmul family is one
    (`Module.Linear` -> `linear`) wherever MATMULS is looked up."""
    return function_name(api).lower()



def half_precision(unit: np.ndarray) -> np.ndarray:
    """Whether each unit roundoff is bfloat16's or float16's."""
    return np.isin(np.asarray(unit, np.float64), (UNIT_ROUNDOFF["bfloat16"], UNIT_ROUNDOFF["float16"]))


def noise_floor(unit: np.ndarray) -> np.ndarray:
    """F × u: the error rounding alone may put on a result of unit roundoff u (on both sides)."""
    unit = np.asarray(unit, np.float64)
    return np.where(half_precision(unit), FLOOR_UNITS_HALF, FLOOR_UNITS) * unit


def rounding_scale(condition: np.ndarray, rule: np.ndarray) -> np.ndarray:
    """How much a call's own rounding grows: C for the calls that sum (SUMMING_RULES: their terms'
    rounding cancels as their values do), 1 for the others."""
    return np.where(np.isin(np.asarray(rule, object), list(SUMMING_RULES)), condition, 1.0)


def rounding_floor(unit: np.ndarray, condition: np.ndarray, rule: np.ndarray, api: np.ndarray | Coded) -> np.ndarray:
    """The error a call's own rounding may put on its result (on both sides): F × u × S. The matmul
    family's kernels, forward and backward, accumulate in float32 at least (every device's GEMMs in
    half precision; a product of two half-precision numbers is exact in float32) and round their
    result once: only the accumulator's rounding grows with the cancellation, so in half precision
    their floor is the larger of the result's rounding, F u, and the accumulator's, F u₃₂ S (a 3 %
    fault of a linear's gradient in bfloat16, C = 12, once hid under 2 u × 12 = 9 %). Other sums
    may round partial sums in their result's precision (torch's CPU layer_norm gradient in bfloat16
    does, its bias gradient 2.7 % apart between 1 and 2 threads): S = C on F u. A module of the
    family (`Module.Linear`: msprobe's dumps may hold its backward and not its linear's) is one.
    An optimizer's update is several operations: UPDATE_ROUNDINGS × F u."""
    unit = np.asarray(unit, np.float64)
    apis = api if isinstance(api, Coded) else Coded.of(np.atleast_1d(np.asarray(api, object)))
    accumulator = np.where(isin(recoded(matmul_name, apis), MATMULS), np.minimum(unit, UNIT_ROUNDOFF["float32"]), unit)
    own = noise_floor(unit) * np.where(isin(apis, (OPTIMIZER_API,)), UPDATE_ROUNDINGS, 1.0)
    return np.maximum(own, noise_floor(accumulator) * rounding_scale(condition, rule))


def invariant_errors(of: CallRecords) -> np.ndarray:
    """Per call, the error of the statistics its result keeps whatever its inputs (a softmax's
    mean: every row sums to one), 0 where it keeps none. Its records as for `conditions`, with
    `mean_val_rel_err`."""
    calls = of.calls
    function = recoded(function_name, calls.coded("api"))
    softmax = np.flatnonzero((~calls.isin("direction", "backward")) & isin(function, SOFTMAXES))
    invariant = np.zeros(len(calls))
    invariant[softmax] = np.nan_to_num(of.output_statistic_error(softmax, "mean_val_rel_err"))
    return invariant


def conditions(of: CallRecords) -> tuple[np.ndarray, np.ndarray]:
    """The condition C of every call and the rule that gave it ("" where C = 1), from its records
    (side A's norm, mean, min, max and shape, their role and arg_index; the call's rank, step, name
    and direction: a softmax's backward reads its forward call's output, a root's its forward call's
    input) by its API (the tables above), its backward summing a gradient over positions
    (`reduction_condition`) or its selecting a part of its input (SELECTIONS: ‖x‖ / ‖part‖, all of
    the input's error may sit in the part)."""
    calls, records, call_of_record = of.calls, of.records, of.call_of_record
    function = recoded(function_name, calls.coded("api"))
    forward = ~calls.isin("direction", "backward")
    condition, rule = np.ones(len(calls)), np.full(len(calls), "", object)

    def apply(values: np.ndarray, name: str) -> None:
        values = np.where(np.isnan(values), 1.0, values)
        larger = values > condition
        condition[larger], rule[larger] = values[larger], name

    apply(_summing_conditions(calls, records, call_of_record), "gradient sum")
    apply(_selection_conditions(calls, records, call_of_record, function), "selection")
    apply(np.where(forward & isin(function, PRODUCTS), np.minimum(2.0, of.count("input")), 1.0), "product")
    apply(_row_scaled_product_conditions(function, forward, of), "row-scaled product")
    apply(np.where(forward & isin(function, POWERS), 2.0, 1.0), "power")
    apply(_product_gradient_conditions(calls, function, of), "product gradient")
    for name, (index, from_ratio) in QUOTIENTS.items():
        at = np.flatnonzero(forward & isin(function, (name,)))
        if len(at):
            apply(_at(len(calls), at, from_ratio(of.closeness_to_zero(at, index))), "quotient")
    for name, exponent in POWER_GRADIENTS.items():
        at = np.flatnonzero(calls.isin("direction", "backward") & isin(function, (name,)))
        saved = of.forward_call[at]
        ratio = np.full(len(at), np.nan)  # no forward call recorded: C = 1
        ratio[saved >= 0] = of.closeness_to_zero(saved[saved >= 0], 0)
        apply(_at(len(calls), at, 1.0 + abs(exponent - 1.0) * ratio), "quotient gradient")
    addition = np.flatnonzero(forward & isin(function, ADDITIONS))
    with np.errstate(divide="ignore", invalid="ignore"):
        apply(_at(len(calls), addition, of.input_norms(addition) / of.norm(addition, "output", 0)), "cancellation")
    exponential = np.flatnonzero(forward & isin(function, EXPONENTIALS))
    apply(_at(len(calls), exponential, of.scale(exponential, "input", 0)), "exponential")
    softmax = np.flatnonzero(forward & isin(function, SOFTMAXES))
    apply(_at(len(calls), softmax, 2.0 * of.scale(softmax, "input", 0)), "softmax")
    softmax_gradient = np.flatnonzero(calls.isin("direction", "backward") & isin(function, SOFTMAXES))
    apply(_at(len(calls), softmax_gradient, _softmax_gradient_conditions(calls, of, softmax_gradient)),
          "softmax gradient")
    log_softmax = np.flatnonzero(forward & isin(function, LOG_SOFTMAXES))
    with np.errstate(divide="ignore", invalid="ignore"):
        spread = of.scale(log_softmax, "input", 0) / of.scale(log_softmax, "output", 0)
    apply(_at(len(calls), log_softmax, 2.0 * spread), "softmax")
    normalization = np.flatnonzero(forward & isin(function, NORMALIZATIONS))
    apply(_at(len(calls), normalization, of.rms_over_std(normalization)), "normalization")
    for name, scaling in REDUCTIONS.items():
        at = np.flatnonzero(forward & isin(function, (name,)))
        if len(at):
            apply(_at(len(calls), at, of.reduction(at, scaling)), "reduction")
    apply(_matmul_conditions(calls, of), "matmul")
    return condition, rule


def _at(n: int, at: np.ndarray, values: np.ndarray) -> np.ndarray:
    """`values` at the calls `at`, NaN (no condition) elsewhere."""
    out = np.full(n, np.nan)
    out[at] = values
    return out


class CallRecords:
    """The records of the calls (`call_of_record`: each record's row in `calls`), found by role and
    argument index, with side A's statistics: what every bound of a call table reads, made once."""

    def __init__(self, calls: Table, records: Table, call_of_record: np.ndarray):
        self.calls, self.records, self.call_of_record, self.n_calls = calls, records, call_of_record, len(calls)
        self.index = KeyIndex([call_of_record, records.coded("role"), records["arg_index"]])  # asked once per bound
        self.norms = records["norm_a"].astype(np.float64)
        low, high = records["min_a"].astype(np.float64), records["max_a"].astype(np.float64)
        with np.errstate(invalid="ignore"):
            finite = lambda v: np.where(np.isfinite(v), np.abs(v), np.nan)  # noqa: E731
            self.scales = np.fmax(finite(low), finite(high))  # max |x|, a mask of -inf left out
            self.nearest_zero = np.where((low <= 0) & (high >= 0), 0.0, np.fmin(np.abs(low), np.abs(high)))
        self.means = records["mean_a"].astype(np.float64)
        self.numels = numels(records["shape_a"])

    def record(self, at: np.ndarray, role: str, index) -> np.ndarray:
        """The row in `records` of each call's tensor of that role and argument index, -1 where none."""
        index = np.broadcast_to(np.asarray(index, np.int64), at.shape)
        return self.index.rows([at, Coded(np.array([role], object), np.zeros(len(at), np.int64)), index])

    def _of(self, column: np.ndarray, at: np.ndarray, role: str, index) -> np.ndarray:
        found = self.record(at, role, index)
        return np.where(found >= 0, column[np.maximum(found, 0)], np.nan) if len(column) else np.full(len(at), np.nan)

    def norm(self, at: np.ndarray, role: str, index) -> np.ndarray:
        return self._of(self.norms, at, role, index)

    def scale(self, at: np.ndarray, role: str, index) -> np.ndarray:
        """max |x| of each call's tensor of that role and index (its finite extremes)."""
        return self._of(self.scales, at, role, index)

    def input_values(self, column: str, at: np.ndarray) -> np.ndarray:
        """A records' column (float) of each call's first two inputs: 2 × len(at), NaN where none."""
        values = self.records[column].astype(np.float64)
        return np.stack([self._of(values, at, "input", index) for index in (0, 1)])

    def _of_role(self, role: str) -> np.ndarray:
        return isin(self.records.coded("role"), (role,))

    def count(self, role: str) -> np.ndarray:
        """Per call, how many tensors of that role it has."""
        return np.bincount(self.call_of_record[self._of_role(role)], minlength=self.n_calls)

    def input_norms(self, at: np.ndarray) -> np.ndarray:
        """Σ ‖inputs‖ of each call."""
        mine = self._of_role("input")
        return np.bincount(self.call_of_record[mine], np.nan_to_num(self.norms[mine]), minlength=self.n_calls)[at]

    def closeness_to_zero(self, at: np.ndarray, index: int) -> np.ndarray:
        """R = max|x| / min|x| of each call's input `index`: inf where x reaches zero, 0 where that
        input is no tensor (a number divides: it holds no error)."""
        found = self.record(at, "input", index)
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = self._of(self.scales, at, "input", index) / self._of(self.nearest_zero, at, "input", index)
        return np.where(found >= 0, np.where(np.isnan(ratio), np.inf, ratio), 0.0)

    def rms_over_std(self, at: np.ndarray) -> np.ndarray:
        """‖x‖ / √(‖x‖² − n mean²) of each call's first input (1 where unknown)."""
        norm, n, mean = (self._of(column, at, "input", 0) for column in (self.norms, self.numels, self.means))
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = norm / np.sqrt(norm**2 - n * mean**2)
        return np.where(np.isfinite(ratio), ratio, 1.0)

    def reduction(self, at: np.ndarray, scaling: str) -> np.ndarray:
        """The condition of a forward sum or mean of P terms into each result element, where fewer
        elements come out than go in (1 elsewhere): reduction_condition, the result's norm taken
        × P for a mean."""
        in_norm, in_numel = self._of(self.norms, at, "input", 0), self._of(self.numels, at, "input", 0)
        out_norm, out_numel = self._of(self.norms, at, "output", 0), self._of(self.numels, at, "output", 0)
        with np.errstate(divide="ignore", invalid="ignore"):
            terms = in_numel / out_numel
            condition = reduction_condition(in_norm, in_numel, out_norm * (terms if scaling == "mean" else 1.0),
                                            out_numel)
        return np.where((out_numel > 0) & (out_numel < in_numel), condition, 1.0)

    def output_statistic_error(self, at: np.ndarray, metric: str) -> np.ndarray:
        """The largest error of one statistic over each call's outputs (0 where none is known)."""
        mine = np.flatnonzero(np.isin(self.call_of_record, at) & self._of_role("output"))
        largest = np.zeros(self.n_calls)
        np.fmax.at(largest, self.call_of_record[mine], self.records[metric].astype(np.float64)[mine])
        return largest[at]


    @functools.cached_property
    def forward_call(self) -> np.ndarray:
        """Per call, the row of the first forward call of the same rank, step and name (what a
        backward call's forward saved for it), -1 where there is none."""
        calls, keys = self.calls, ("rank", "step", "name")
        forward = np.flatnonzero(calls.isin("direction", "forward"))
        found = lookup([calls.coded(k) for k in keys], [calls.coded(k).take(forward) for k in keys])
        return np.where(found >= 0, forward[np.maximum(found, 0)] if len(forward) else -1, -1)


def _softmax_gradient_conditions(calls: Table, of: CallRecords, at: np.ndarray) -> np.ndarray:
    """C = 2 max p ‖g‖ / ‖dz‖ for softmax backward calls `at`: dz = p ⊙ g − p (p · g) row by row,
    and each term moves by at most max p ‖δg‖ (the second as ‖p‖² ≤ max p Σ p = max p), so an
    error of g (or, alike, of the saved p) grows by the cancellation of the two terms. max p from
    the forward call's output, 1 (a probability's largest) where it was not recorded."""
    saved = of.forward_call[at]
    largest = np.ones(len(at))
    found = saved >= 0
    largest[found] = of.scale(saved[found], "output", 0)
    largest = np.fmin(np.where(np.isnan(largest), 1.0, largest), 1.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        return 2.0 * largest * of.norm(at, "grad_output", 0) / of.norm(at, "grad_input", 0)


def _product_gradient_conditions(calls: Table, function: np.ndarray, of: CallRecords) -> np.ndarray:
    """The gradients of products are products too: a factor's is g ⊙ the other factor, C = 2 where
    the forward call multiplied two tensors (1 by a number, or where it was not recorded); a
    power's is g ⊙ p x^(p-1), C = 2 as for the forward square. NaN elsewhere."""
    at = np.flatnonzero(calls.isin("direction", "backward") & isin(function, PRODUCTS | POWERS))
    saved = of.forward_call[at]
    factors = np.where(saved >= 0, of.count("input")[np.maximum(saved, 0)], 1)
    return _at(len(calls), at, np.where(isin(function.take(at), POWERS), 2.0, np.minimum(2.0, factors)))


def _row_scaled_product_conditions(function: np.ndarray, forward: np.ndarray, of: CallRecords) -> np.ndarray:
    """C = (ρ_a + ρ_s) / e_in for a product of two tensors, one of them constant along the other's
    rows (its last dimension 1), ρ each factor's largest relative L2 error of a row along the last
    dimension and e_in the larger of their relative L2 errors: every row of a s is a row of a times
    one element of s, so its relative error is at most ρ_a + ρ_s, and so is the whole's. NaN (the
    rule not taken) elsewhere, and where a factor's rows were not measured (statistics, samples)."""
    condition = np.full(of.n_calls, np.nan)
    at = np.flatnonzero(forward & isin(function, MULTIPLICATIONS) & (of.count("input") == 2))
    if not len(at):
        return condition
    shapes = of.records["shape_a"]
    last = [np.array([(_last_dimension(str(shapes[i])) or 1) if i >= 0 else 0  # a 0-d tensor's: 1
                      for i in of.record(at, "input", index).tolist()]) for index in (0, 1)]
    row_error, error = (of.input_values(column, at) for column in ("max_row_rel_l2_err", "rel_l2_err"))
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = row_error.sum(0) / error.max(0)
    scaled = np.minimum(*last) == 1  # both found, one of them a per-row scale
    condition[at] = np.where(scaled & np.isfinite(ratio), ratio, np.nan)
    return condition


def extremes_conditions(of: CallRecords) -> np.ndarray:
    """The condition of the extremes of a call's result (channels.introduced_by_channel): for the
    matmul family, ‖A‖ ‖B‖ / (√K ‖AB‖) over the whole batch, which also covers how an average
    (a softmax's weights times V) shrinks the result's largest magnitude against its operands';
    NaN for the other calls (their `conditions`). With the per-product C, noise in the extremes
    of the toy transformer's weights times V came out 2× its bound (C 3.2 → 1)."""
    return _matmul_conditions(of.calls, of, per_product=False)


def _module_weights(calls: Table, of: CallRecords, at: np.ndarray) -> np.ndarray:
    """The record of the weight `<module>.weight` of each call `at` that is a module's (its
    Parameter record of the same rank and step, as the step's forward read it), -1 elsewhere: a
    module call's records hold its inputs and outputs, not its parameters, and without its weight a
    `Module.Linear`'s condition was unknown: 1 forward, the call's for its input gradient (where
    the input has fewer features than the output, the sum over positions' C of its smaller result)."""
    weights = np.full(len(at), -1, np.int64)
    module = np.flatnonzero(is_module_api(calls.coded("api").take(at))) if len(at) else at
    parameters = np.flatnonzero(calls.isin("direction", "parameter"))
    if not len(module) or not len(parameters):
        return weights
    names = np.array([f"{path}.weight" for path in calls["module"][at[module]].tolist()], object)
    found = lookup([calls["rank"][at[module]], calls["step"][at[module]], names],
                   [calls["rank"][parameters], calls["step"][parameters], subjects(calls["name"][parameters])])
    owner = parameters[np.maximum(found, 0)]
    weights[module] = np.where(found >= 0, of.record(owner, "parameter", 0), -1)
    return weights


def _matmul_conditions(calls: Table, of: CallRecords, per_product: bool = True) -> np.ndarray:
    """C = ‖A‖ ‖B‖ / (√K √n ‖AB‖) for the matmul family (K the reduction length, n the products
    of a batch both operands hold, 1 unless `per_product`; NaN elsewhere): an operand's relative
    error ε becomes about ε ‖A‖ ‖B‖ / (√K ‖AB‖) in one product, 1 for operands of independent
    entries, more where the product cancels. A batch of n products (attention's scores: one a
    batch item and head) sums n of them in each norm: ‖A‖ ‖B‖ is √n times ‖AB‖'s scale where
    nothing cancels (PI0 tiny's eager attention, batch 8 × 8 heads: C was 8, and its scores 5 %
    off were within it wherever their inputs already differed), taken alike across the batch; a
    weight shared by the batch (a linear's) is one operand of every product, and no batch."""
    function = recoded(matmul_name, calls.coded("api"))
    condition = np.full(len(function), np.nan)
    matmul = np.flatnonzero(isin(function, MATMULS))
    if not len(matmul):
        return condition
    operands = np.array([MATMULS[f] for f in function.take(matmul).values.tolist()], np.int64).reshape(-1, 2)
    first, second = of.record(matmul, "input", operands[:, 0]), of.record(matmul, "input", operands[:, 1])
    second = np.where(second < 0, _module_weights(calls, of, matmul), second)
    result = of.record(matmul, "output", 0)
    found = (first >= 0) & (second >= 0) & (result >= 0)
    call, i, j, k = matmul[found], first[found], second[found], result[found]
    norms, shapes = of.norms, of.records["shape_a"]
    reduction = mapped(shapes[i], lambda shape: _last_dimension(str(shape)), np.int64)
    products = np.minimum(*(mapped(shapes[m], lambda shape: _batch(str(shape)), np.int64) for m in (i, j))) \
        if per_product else np.ones(len(call), np.int64)
    with np.errstate(over="ignore", invalid="ignore"):
        known = (reduction != 0) & (norms[k] > 0) & np.isfinite(norms[i] * norms[j])
    call, i, j, k = call[known], i[known], j[known], k[known]
    condition[call] = matmul_condition(norms[i], norms[j], norms[k], reduction[known], products[known])
    return condition


def matmul_condition(norm_a, norm_b, norm_product, reduction, products):
    """‖A‖ ‖B‖ / (√(K n) ‖AB‖), at least 1: the matmul family's condition, K the reduction length
    and n the products of a batch both operands hold (`_matmul_conditions`)."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        return np.maximum(1.0, norm_a * norm_b / (np.sqrt(reduction * products) * norm_product))


def result_conditions(of: CallRecords) -> tuple[np.ndarray, np.ndarray]:
    """(C, C of the extremes) of each result of a backward call of the matmul family, NaN for the
    other records (the call's C stands): a call's one C, the largest over its results, held a
    linear's input gradient 5 % off to its bias gradient's C (3.7, PI0 tiny's expert up_proj 12).
    A gradient towards an operand is a product of the incoming gradient G and the other operand O
    (dX = G W, dW = Gᵀ X): C = ‖G‖ ‖O‖ / (√(K n) ‖R‖), the matmul family's formula, with
    K² n = N_G N_O / N_R read from the elements of G, O and the result R (K the reduction length:
    dX's the output features, dW's the positions; n the products of a batch all three hold; the
    extremes' C over the whole batch, n = 1, as `extremes_conditions`); the other results sum G
    over positions (a bias's): reduction_condition."""
    calls, records, call_of_record = of.calls, of.records, of.call_of_record
    condition, extremes = np.full(len(records), np.nan), np.full(len(records), np.nan)
    function = recoded(matmul_name, calls.coded("api"))
    backward = np.flatnonzero(calls.isin("direction", "backward") & isin(function, MATMULS))
    if not len(backward):
        return condition, extremes
    position = np.full(len(calls), -1, np.int64)
    position[backward] = np.arange(len(backward))
    results = np.flatnonzero((position[call_of_record] >= 0) & records.isin("role", "grad_input"))
    k = position[call_of_record[results]]
    g = of.record(backward, "grad_output", 0)[k]
    operands = np.array([MATMULS[f] for f in function.take(backward).values.tolist()], np.int64).reshape(-1, 2)[k]
    arg = records["arg_index"][results]
    towards_operand = (operands == arg[:, None]).any(axis=1)
    other_operand = np.where(operands[:, 0] == arg, operands[:, 1], operands[:, 0])
    other = of.record(of.forward_call[backward][k], "input", other_operand)  # -1 where none
    other = np.where((other < 0) & (other_operand == 1), _module_weights(calls, of, backward)[k], other)
    norms, numel, shapes = of.norms, of.numels, records["shape_a"]
    known = (g >= 0) & (norms[results] > 0) & (numel[results] > 0)
    bias, summed = known & ~towards_operand, results[known & ~towards_operand]
    condition[summed] = reduction_condition(norms[g[bias]], numel[g[bias]], norms[summed], numel[summed])
    taken = known & towards_operand & (other >= 0)
    r, g, other = results[taken], g[taken], other[taken]
    products = np.array([min(_batch(str(shapes[i])), _batch(str(shapes[j])), _batch(str(shapes[m])))
                         for i, j, m in zip(g.tolist(), other.tolist(), r.tolist())], np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        reduction = np.sqrt(numel[g] * numel[other] / numel[r] / products)  # K
    per_product = matmul_condition(norms[g], norms[other], norms[r], reduction, products)
    finite = np.isfinite(per_product)
    condition[r[finite]] = per_product[finite]
    extremes[r[finite]] = matmul_condition(norms[g], norms[other], norms[r], reduction, 1.0)[finite]
    return condition, extremes


def step_bounds(of: CallRecords, error: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per optimizer update (recorded, or stood for by the parameter it made), the largest relative
    error its parameter can leave it with: (e_p ‖p‖ + 2 s √n) / ‖p'‖, with e_p the error of the
    parameter it read, ‖p‖ and ‖p'‖ the parameter's norm before and after, n its elements and s the
    most an update moves one element (arguments.adam_step: Adam's step is bounded by the learning
    rate; each side moves an element by at most s, so the two sides by at most 2 s). For updates not
    recorded, s sums the learning rates logged over the steps between, with torch's default betas;
    from the same initial weights (`from_start`: step 0 not dumped), e_p is 0. NaN where the
    step is not known (not an Adam-family optimizer, no learning rate logged).
    Returns the bounds, and the error of the parameter each update left."""
    calls, records = of.calls, of.records
    bound, left = np.full(len(calls), np.nan), np.full(len(calls), np.nan)
    update = np.flatnonzero(calls.isin("direction", "optimizer"))
    standing = np.flatnonzero(calls.isin("direction", "parameter") & (calls["previous_step"] >= 0))
    if not len(update) and not len(standing):
        return bound, left
    norm, numel = of.norms, of.numels

    def record(at: np.ndarray, role: str) -> np.ndarray:
        return of.record(at, role, 0)

    before, after = record(update, "input"), record(update, "output")
    step = np.full(len(update), np.nan)
    found = after >= 0
    step[found] = records["update_step"].astype(np.float64)[after[found]]
    # updates not recorded: from the parameter at the dumped step before to this one
    previous = lookup([calls[k][standing] for k in ("rank", "name", "direction")] + [calls["previous_step"][standing]],
                      [calls[k] for k in ("rank", "name", "direction", "step")])
    mine = record(standing, "parameter")
    theirs = np.where(previous >= 0, record(np.maximum(previous, 0), "parameter"), -1)
    start = calls["from_start"][standing].astype(bool)  # from the same initial weights: e_p = 0
    rates = records["learning_rate_sum"].astype(np.float64)
    rate_before = np.where(theirs >= 0, rates[np.maximum(theirs, 0)], np.where(start, 0.0, np.nan))
    summed = np.where(mine >= 0, rates[np.maximum(mine, 0)] - rate_before, np.nan)
    at = np.concatenate([update, standing])
    p_before, p_after = np.concatenate([before, theirs]), np.concatenate([after, mine])
    s = np.concatenate([step, summed * adam_step_for(1.0)])
    known = ((p_before >= 0) | np.concatenate([np.zeros(len(update), bool), start])) & (p_after >= 0) & np.isfinite(s)
    i, j = p_before[known], p_after[known]
    with np.errstate(divide="ignore", invalid="ignore"):
        carried = np.where(i >= 0, error[np.maximum(i, 0)] * norm[np.maximum(i, 0)], 0.0)
        moved = np.where(np.isnan(carried), 0.0, carried) + 2.0 * s[known] * np.sqrt(numel[j])
        bound[at[known]] = np.where(norm[j] > 0, moved / norm[j], np.inf)
    found = p_after >= 0
    left[at[found]] = error[p_after[found]]
    return bound, left


# APIs whose outputs are parts of their first input
SELECTIONS = frozenset({"unbind", "split", "split_with_sizes", "tensor_split", "chunk", "__getitem__", "narrow",
                        "select", "index_select", "gather", "take", "masked_select", "diagonal", "take_along_dim"})


def _selection_conditions(calls: Table, records: Table, call_of_record: np.ndarray, function: np.ndarray) -> np.ndarray:
    """Per selecting call, the largest over its outputs of ‖x‖ / ‖part‖ and max|x| / max|part| (the
    statistics' own scales: the norm's and the extremes'), x its first input; 1 elsewhere."""
    condition = np.ones(len(calls))
    selecting = isin(function, SELECTIONS) & calls.isin("direction", "forward")
    if not selecting.any():
        return condition
    on = selecting[call_of_record]
    whole = np.flatnonzero(on & records.isin("role", "input") & (records["arg_index"] == 0))
    parts = np.flatnonzero(on & records.isin("role", "output"))
    of_call = np.full(len(calls), -1, np.int64)
    of_call[call_of_record[whole]] = whole
    x = of_call[call_of_record[parts]]
    parts, x = parts[x >= 0], x[x >= 0]
    norm = records["norm_a"].astype(np.float64)
    largest = np.fmax(np.abs(records["min_a"].astype(np.float64)), np.abs(records["max_a"].astype(np.float64)))
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.fmax(norm[x] / norm[parts], largest[x] / largest[parts])
    ratio = np.where(np.isfinite(ratio), np.maximum(ratio, 1.0), 1.0)
    np.maximum.at(condition, call_of_record[parts], ratio)
    return condition


def reduction_condition(incoming_norm, incoming_numel, result_norm, result_numel) -> np.ndarray:
    """The condition of a gradient summed over positions, g = Σ_p G_p (P = numel(G) / numel(g)
    terms): an error of G may add up alike at every position while the values cancel, so by the
    triangle inequality ‖δg‖ ≤ √P ‖δG‖, and g's relative error is at most √P ‖G‖ / ‖g‖ times G's
    (1 for terms of independent signs, more where the sum cancels)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.sqrt(np.asarray(incoming_numel, np.float64) / np.asarray(result_numel, np.float64))
        condition = ratio * np.asarray(incoming_norm, np.float64) / np.asarray(result_norm, np.float64)
    return np.where(np.isfinite(condition), np.maximum(condition, 1.0), 1.0)


def _summing_conditions(calls: Table, records: Table, call_of_record: np.ndarray) -> np.ndarray:
    """Per call, the largest reduction_condition of its backward results with fewer elements than
    its incoming gradient (1 where it has none)."""
    condition = np.ones(len(calls))
    backward = records.isin("direction", "backward")
    incoming = np.flatnonzero(backward & records.isin("role", "grad_output") & (records["arg_index"] == 0))
    results = np.flatnonzero(backward & records.isin("role", "grad_input"))
    if not len(incoming) or not len(results):
        return condition
    norm = records["norm_a"].astype(np.float64)
    numel = numels(records["shape_a"])
    of_call = np.full(len(calls), -1, np.int64)
    of_call[call_of_record[incoming]] = incoming
    g = of_call[call_of_record[results]]
    summed = results[(g >= 0) & (numel[results] < numel[np.maximum(g, 0)])]
    g = of_call[call_of_record[summed]]
    summing = reduction_condition(norm[g], numel[g], norm[summed], numel[summed])
    np.maximum.at(condition, call_of_record[summed], summing)
    return condition


@functools.lru_cache(maxsize=4096)
def dimensions(shape: str) -> tuple[int, ...] | None:
    """A record's shape (its text, as `[2, 3]`) as a tuple; None when it is not one."""
    try:
        dims = json.loads(shape)
    except (json.JSONDecodeError, TypeError):
        return None
    return tuple(dims) if isinstance(dims, list) and all(isinstance(d, int) for d in dims) else None


def numels(shapes: np.ndarray) -> np.ndarray:
    """Each record's number of elements from its shape's text (0 where it is not one), each
    distinct shape read once."""
    shapes = shapes.tolist()
    table = {shape: _numel(str(shape)) for shape in set(shapes)}
    return np.array([table[shape] for shape in shapes], np.float64)


def _numel(shape: str) -> int:
    dims = dimensions(shape)
    return 0 if dims is None else math.prod(dims)


def _batch(shape: str) -> int:
    """The matrices an operand of a matmul holds: the product of its dimensions before the last
    two (1 for a matrix or a vector)."""
    dims = dimensions(shape)
    return math.prod(dims[:-2]) if dims and len(dims) > 2 else 1


def _last_dimension(shape: str) -> int:
    dims = dimensions(shape)
    return dims[-1] if dims else 0


def explained_error(input_error: np.ndarray, condition: np.ndarray, floor: np.ndarray) -> np.ndarray:
    """max(C × e_in, floor): the output error a call's inputs and its rounding explain (an input
    without error explains nothing, however large C)."""
    with np.errstate(over="ignore", invalid="ignore"):
        propagated = np.where(input_error == 0, 0.0, condition * input_error)
        return np.maximum(propagated, np.where(floor > 0, floor, np.finfo(float).tiny))


def introduced(output_error: np.ndarray, input_error: np.ndarray, condition: np.ndarray,
               floor: np.ndarray) -> np.ndarray:
    """e_out / max(C × e_in, floor): how many times more error leaves the call than its inputs and
    rounding explain."""
    with np.errstate(over="ignore", invalid="ignore"):
        return np.where(np.isnan(output_error), np.nan, output_error / explained_error(input_error, condition, floor))
