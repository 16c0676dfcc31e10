"""Values as every JSON report writes them (compare's, audit's, bisect's, curves'): NaN as null,
numpy scalars as Python's, calls as objects, under one schema version."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from pi0align.compare.result import CallRef

JSON_SCHEMA_VERSION = 1
_PLAIN = {str, int, bool, type(None)}  # JSON-ready as they are


def json_safe(value: Any) -> Any:
    """`value` with NaN/Inf as None, numpy and pandas scalars as Python ones, tuples as lists.

    Strict JSON has no NaN; a null says "not computable" just as well.
    """
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):  # plain values inline: charts carry lists of 20k points
        return [v if type(v) in _PLAIN or (type(v) is float and math.isfinite(v)) else json_safe(v) for v in value]
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):  # numpy scalar or array
        return json_safe(value.tolist())
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if _is_missing(value):  # pandas.NA, NaT
        return None
    return str(value)


def _is_missing(value: Any) -> bool:
    try:
        return bool(value != value)  # NaN-like values are unequal to themselves
    except TypeError:  # pandas.NA refuses bool()
        return True


def call_dict(call: CallRef) -> dict[str, Any]:
    """A call or culprit as a JSON object: step, name, module, api, direction, stack, rank, then the rest."""
    return json_safe(dataclasses.asdict(call))
