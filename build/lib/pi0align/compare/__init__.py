"""Compare two dumps: align, measure, judge, and name the call that introduced the error.

No torch at import time: this package runs on a laptop that only has the dumps.
"""

from pi0align.compare.calibrate import calibrate
from pi0align.compare.engine import compare_dumps
from pi0align.compare.judging.thresholds import DEFAULT_THRESHOLDS, load_thresholds, parse_overrides
from pi0align.compare.result import ROW_COLUMNS, CallRef, Comparison, Culprit

__all__ = ["compare_dumps", "calibrate", "load_thresholds", "parse_overrides", "DEFAULT_THRESHOLDS",
           "Comparison", "CallRef", "Culprit", "ROW_COLUMNS"]
