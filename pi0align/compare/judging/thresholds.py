"""Pass/warn/fail thresholds per dtype: defaults with their sources, loading and overrides.

A thresholds dict maps a dtype class (float64, float32, bfloat16, float16, integer) to
{metric: limit}. Error metrics fail above their limit; `cosine` fails below it. A pair warns when
an error exceeds `warn_fraction` times its limit (for cosine: when 1 - cosine does).
Sources and reasoning: docs/compare.md, section Thresholds.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np

from pi0align.compare.table import Coded, mapped, recoded
from pi0align.errors import UserError

# Error metrics judged against a limit (everything in metrics.py except the informative ones:
# max/mean elementwise relative error and the 1‰/5‰ shares, which explode on values near zero).
JUDGED_ERRORS = ["rel_l2_err", "norm_rel_err", "mean_val_rel_err", "min_rel_err", "max_val_rel_err",
                 "nan_inf_mismatch"]
THRESHOLD_KEYS = JUDGED_ERRORS + ["cosine", "warn_fraction"]


# A pair warns above a tenth of a limit: an order of magnitude under the fault the limit marks,
# where a kernel's drift first shows (docs/compare.md, Thresholds).
WARN_FRACTION = 0.1


def _limits(relative: float, cosine: float) -> dict[str, float]:
    return {"rel_l2_err": relative, "norm_rel_err": relative, "mean_val_rel_err": relative,
            "min_rel_err": relative, "max_val_rel_err": relative, "nan_inf_mismatch": 0.0,
            "cosine": cosine, "warn_fraction": WARN_FRACTION}


# float32 1e-4: Ascend's operator precision standard for fp32 (relative error within 1/10000,
# "double ten-thousandth"), about 1000x fp32's unit roundoff 6e-8 -- room for reduction-order
# noise through a deep network, and 10x below the 1e-3 error of a real fault.
# float16 1e-3 and bfloat16 4e-3: the same standard's "double thousandth" for fp16 and its
# bf16 variant (bf16 has 8 significant bits: unit roundoff 3.9e-3, fp16 4.9e-4).
# cosine: msprobe's accuracy-comparison pass line is 0.99 for low precision; we use far tighter
# lines derived from the relative limits (1 - cos ~ rel_l2^2 / 2), with a factor for safety.
DEFAULT_THRESHOLDS: dict[str, dict[str, float]] = {
    "float64": _limits(1e-10, 1 - 1e-12),
    "float32": _limits(1e-4, 1 - 1e-6),
    "float16": _limits(1e-3, 1 - 1e-4),
    "bfloat16": _limits(4e-3, 1 - 1e-3),
    # indices, masks, token ids: any difference is real (cosine's own float64 rounding aside)
    "integer": _limits(0.0, 1 - 1e-12),
}
DTYPE_ALIASES = {"fp64": "float64", "double": "float64", "fp32": "float32", "float": "float32",
                 "fp16": "float16", "half": "float16", "bf16": "bfloat16", "int": "integer"}
UNIT_ROUNDOFF = {"float64": 2.0**-53, "float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8,
                 "integer": 0.5}


def dtype_class(dtype: str) -> str:
    """Threshold class of a torch dtype name (float8 and unknown floats judged as bfloat16)."""
    dtype = str(dtype).removeprefix("torch.")
    if dtype in DEFAULT_THRESHOLDS:
        return dtype
    if dtype.startswith(("int", "uint", "bool")):
        return "integer"
    return DTYPE_ALIASES.get(dtype, "bfloat16")


def looser(dtype_a: str, dtype_b: str) -> str:
    """The class with the larger unit roundoff: a pair of different dtypes is judged by it."""
    return max((dtype_class(dtype_a), dtype_class(dtype_b)), key=UNIT_ROUNDOFF.__getitem__)


def looser_classes(dtypes_a: np.ndarray | Coded, dtypes_b: np.ndarray | Coded) -> Coded:
    """looser() for two columns of dtypes at once ("" where either side has no dtype), coded."""
    return recoded(lambda a, b: looser(a, b) if a and b else "", dtypes_a, dtypes_b)


def unit_roundoffs(dtypes) -> np.ndarray:
    """Per record, the unit roundoff of its dtype; 0 where it has none."""
    return class_roundoffs(mapped(dtypes, lambda dtype: dtype_class(dtype) if dtype else ""))


def class_roundoffs(classes) -> np.ndarray:
    """Per record, the unit roundoff of its class (a row's `dtype_class`: of the looser of its two
    dtypes, looser_classes); 0 where it has none."""
    return mapped(classes, lambda cls: UNIT_ROUNDOFF[cls] if cls else 0.0, np.float64)


def load_thresholds(path: str | Path | None = None, overrides: dict[str, float | str] | None = None,
                    base: dict | None = None) -> dict:
    """`base` (the defaults when None), updated from a JSON or TOML file ({dtype: {metric: value}}),
    then from overrides {"dtype.metric": value} (e.g. {"fp32.rel_l2_err": 1e-5}). Bad input raises
    UserError."""
    thresholds = copy.deepcopy(DEFAULT_THRESHOLDS if base is None else base)
    if path is not None:
        for dtype, limits in _read_file(Path(path)).items():
            if not isinstance(limits, dict):
                raise UserError(f"{path}: {dtype!r} must map metrics to numbers")
            for metric, value in limits.items():
                _set(thresholds, dtype, metric, value, str(path))
    for key, value in (overrides or {}).items():
        dtype, _, metric = str(key).partition(".")
        if not metric:
            raise UserError(f"threshold override {key!r}: expected DTYPE.METRIC=VALUE, e.g. fp32.rel_l2_err=1e-5")
        _set(thresholds, dtype, metric, value, "override")
    return thresholds


def parse_overrides(items: list[str]) -> dict[str, str]:
    """["fp32.rel_l2_err=1e-5", ...] -> {"fp32.rel_l2_err": "1e-5"}: for the command line."""
    result = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise UserError(f"threshold override {item!r}: expected DTYPE.METRIC=VALUE")
        result[key.strip()] = value.strip()
    return result


def _read_file(path: Path) -> dict:
    try:
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".toml":
            import tomllib  # here: a compare without a TOML file does not pay its import

            data = tomllib.loads(text)
        else:
            data = json.loads(text)
    except OSError as error:
        raise UserError(f"{path}: cannot read thresholds ({error.strerror})") from None
    except ValueError as error:  # a JSON, TOML or UTF-8 decoding error
        raise UserError(f"{path}: not a valid thresholds file ({error})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: thresholds must be an object {{dtype: {{metric: value}}}}")
    return data.get("thresholds", data)  # also accepts a saved `pi0align compare --json` result


def _set(thresholds: dict, dtype: str, metric: str, value, origin: str) -> None:
    dtype = DTYPE_ALIASES.get(dtype, dtype)
    if dtype not in thresholds:
        raise UserError(f"{origin}: unknown dtype {dtype!r} (known: {', '.join(thresholds)}, fp32, bf16, fp16)")
    if metric not in THRESHOLD_KEYS:
        raise UserError(f"{origin}: unknown metric {metric!r} (known: {', '.join(THRESHOLD_KEYS)})")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise UserError(f"{origin}: {dtype}.{metric} must be a number, got {value!r}") from None
    if number != number or number < 0:
        raise UserError(f"{origin}: {dtype}.{metric} must be a non-negative number, got {value!r}")
    thresholds[dtype][metric] = number
