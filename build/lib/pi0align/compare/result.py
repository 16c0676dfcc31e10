"""The result of comparing two dumps, as plain data: what `report` renders.

No torch here, and no logic beyond trivial accessors: `compare` fills it, `report` reads it.
Its tables (`rows`, `metrics_a`, `metrics_b`) are held as numpy columns and read as pandas
DataFrames, made on first read: comparing and reporting never import pandas.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pi0align.compare.rowstore import RowStore
from pi0align.compare.table import Table

if TYPE_CHECKING:
    import pandas as pd

# The values of the rows' `pairing` (measuring/align.py), and the sets of them stages ask for: a
# record with its counterpart of the same shape and dtype; one whose values can be measured against
# its counterpart's (a dtype apart: compared in the looser); one with a counterpart at all.
PAIRINGS = ("matched", "only_a", "only_b", "realigned", "shape_mismatch", "dtype_mismatch")
SAME_SHAPE_AND_DTYPE = ("matched", "realigned")
COMPARABLE = (*SAME_SHAPE_AND_DTYPE, "dtype_mismatch")
PAIRED = (*COMPARABLE, "shape_mismatch")

# Columns of Comparison.rows, in this order. One row per aligned pair of tensors, or per record
# found on one side only. `a` is the benchmark (B, e.g. GPU), `b` the run under test (N, e.g. NPU).
ROW_COLUMNS = [
    "step",  # int
    "seq_a", "seq_b",  # call sequence numbers, <NA> on the side that lacks the record
    "name", "module", "api", "direction", "role", "arg_index",
    "dtype_a", "dtype_b", "shape_a", "shape_b",
    "pairing",  # "matched" | "realigned" | "only_a" | "only_b" | "shape_mismatch" | "dtype_mismatch"
    "evidence",  # "tensor" | "sample" | "stats": what the metrics were computed from
    # metrics (float64, NaN when not computable from the evidence)
    "cosine", "max_abs_err", "max_rel_err", "mean_rel_err", "rel_l2_err", "rmse",
    "within_1e-3", "within_5e-3", "nan_inf_mismatch",
    "min_rel_err", "max_val_rel_err", "mean_val_rel_err", "norm_rel_err",
    "verdict",  # "pass" | "warn" | "fail" | "n/a"
    "introduced_error",  # float: output error / input error of the call (NaN for inputs)
    "stack",  # str: "file:line function" of the call site, innermost, "" when unknown
    "rank",  # int: the rank both records come from (ranks pair by number)
    "severity",  # float: largest judged error / its threshold (> 1 fails), NaN when not judged
    "local_error_a", "local_error_b",  # float: replay, a result's error against float64 from its side's own inputs
    "replay",  # str: why the call was not replayed ("" when it was, or when there was nothing to replay)
    "over_dtype_limits",  # bool: the pair exceeds the fixed dtype limits (noise models may still pass it)
    "explained_by",  # str: for a `warn` row, the rule that judged it within noise (explain.EXPLAINED_BY), else ""
]


# What a culprit is: an API or module call, the optimizer's update, the batch, a parameter's gradient
# beyond its backward calls, the initial weights, parameters that changed where nothing dumped did.
KINDS = ("call", "optimizer", "data", "gradient", "initial_weights", "parameters")


@dataclass(frozen=True)
class CallRef:
    """One call, as the user needs to find it."""

    step: int
    name: str
    module: str
    api: str
    direction: str  # one of reading.records.DIRECTIONS
    stack: list[str] = field(default_factory=list)
    rank: int = 0
    kind: str = "call"  # one of KINDS


@dataclass(frozen=True)
class Culprit(CallRef):
    introduced_error: float = float("nan")
    input_error: float = float("nan")
    output_error: float = float("nan")
    metric: str = "rel_l2_err"  # which error measure introduced_error is a ratio of
    evidence: str = "intrinsic"  # the noise model that judged it: "replay" | "reference" | "intrinsic"
    wrong_side: str = ""  # replay: "B" (the run under test) or "A" (the benchmark) is the wrong one
    local_error_a: float = float("nan")  # replay: each side's error against float64 from its own inputs
    local_error_b: float = float("nan")
    local_ratio: float = float("nan")  # replay: the wrong side's local error over the other's (floored)
    bound: float = float("nan")  # the output error its inputs and rounding explain (replay: the other side's)
    bound_by: str = ""  # what that bound is made of (culprits.broken_bound)


@dataclass(frozen=True)
class CulpritGroup:
    """Culprits of one kind and API (the matmul family as one API): one finding."""

    kind: str
    api: str  # the API, "matmul family", or for other kinds "Optimizer.step", "Data", "Parameter"
    count: int  # culprits in the group
    calls: int  # judged calls of that kind and API
    share_introducing: float  # share of those calls that introduce error (outputs fail, more out than in)
    median_ratio: float  # median blame of the culprits: local error ratio where replayed, else introduced error
    median_output_error: float
    hint: str = ""  # what the pattern usually means ("" when it is not a known one)
    examples: list[str] = field(default_factory=list)  # names of its first culprits


class TableField:
    """A dataclass field set to a Table, a RowStore or a pandas DataFrame and read as a DataFrame.

    A Table or RowStore is turned into a DataFrame on first read, which then replaces it: changes
    made to the DataFrame are what `Comparison.table()` and the reports see.
    """

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, instance: Any, owner: type | None = None) -> pd.DataFrame:
        if instance is None:
            raise AttributeError(self.name)  # no class-level default: the field is required
        value = instance.__dict__[self.name]
        if isinstance(value, RowStore):
            value = value.table()
        if isinstance(value, Table):
            value = instance.__dict__[self.name] = value.to_pandas()
        return value

    def __set__(self, instance: Any, value: Table | RowStore | pd.DataFrame) -> None:
        instance.__dict__[self.name] = value


@dataclass
class Comparison:
    """Everything one `pi0align compare` found."""

    verdict: str  # "aligned" | "diverged"
    rows: pd.DataFrame = TableField()  # columns ROW_COLUMNS
    coverage: dict[str, int]  # {"matched": n, "only_a": n, "only_b": n}
    first_divergence: CallRef | None
    culprits: list[Culprit]  # earliest step first, most guilty first within a step
    thresholds: dict[str, dict[str, float]]  # per dtype: metric -> threshold
    source_a: str
    source_b: str
    metrics_a: pd.DataFrame = TableField()  # per training step: step, loss, grad_norm, lr
    metrics_b: pd.DataFrame = TableField()
    manifest_diff: list[tuple[str, Any, Any]]  # (dotted key, value in a, value in b)
    notes: list[str] = field(default_factory=list)  # e.g. "initial weights differ"
    first_divergence_backward: CallRef | None = None  # the same search over backward calls
    noise_model: str = "intrinsic"  # the best evidence that judged the run: "replay" | "reference" | "intrinsic"
    rows_over_dtype_limits: int = 0  # pairs beyond the fixed dtype limits, whatever the noise model says
    culprit_groups: list[CulpritGroup] = field(default_factory=list)  # by their first culprit
    explained: dict[str, int] = field(default_factory=dict)  # `warn` rows by the rule that explained them
    rank_verdicts: dict[int, str] = field(default_factory=dict)  # per rank: "aligned" | "diverged"

    @property
    def within_noise(self) -> bool:
        """Aligned, with pairs beyond the fixed dtype limits that the noise model explains."""
        return self.verdict == "aligned" and self.rows_over_dtype_limits > 0

    def table(self, name: str = "rows", columns: list[str] | None = None) -> Table:
        """`rows`, `metrics_a` or `metrics_b` as a Table (these columns, or all), without pandas
        unless a DataFrame is already there (then its current content). The rows of a compare of
        many steps are on disk: `row_parts` reads them a part at a time."""
        value = self.__dict__[name]
        return value.table(columns) if isinstance(value, RowStore) else self._table(name, columns)

    def row_parts(self, columns: list[str] | None = None) -> Iterator[Table]:
        """The rows, a part (a window of steps of one rank) at a time, in order; these columns, or all."""
        value = self.__dict__["rows"]
        if isinstance(value, RowStore):
            yield from value.parts(columns)
            return
        yield self._table("rows", columns)

    def row_column_names(self) -> list[str]:
        """The columns of `rows`: ROW_COLUMNS, and any a user added to the DataFrame."""
        value = self.__dict__["rows"]
        return list(value.columns) if isinstance(value, RowStore | Table) else [str(c) for c in value.columns]

    def _table(self, name: str, columns: list[str] | None = None) -> Table:
        value = self.__dict__[name]
        if isinstance(value, Table):
            return value if columns is None else value.select(columns)
        return Table.from_pandas(value if columns is None else value[columns])
