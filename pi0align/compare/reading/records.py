"""The one in-memory shape every reader produces: a `Dump` (one rank), whatever the file format.

`records` holds one row per captured tensor with the columns in RECORD_COLUMNS (a `Table` of numpy
columns); tensor and sample values stay on disk and are fetched on demand through the Dump's
accessors, so memory stays bounded however large the dump.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pi0align.compare.table import Table, mapped

# the records' columns of few distinct values, coded by the readers (table.Coded): what the compare
# groups and joins on
CODED_COLUMNS = ("module", "api", "direction", "role", "dtype", "shape")
RECORD_COLUMNS = [
    "rank", "step", "call", "seq", "name", "module", "api", "direction", "role", "arg_index",
    "dtype", "shape", "numel", "min", "max", "mean", "norm", "nan_count", "inf_count",
    "stack", "tensor", "sample_row", "sample_count", "checksum",  # checksum -1 when unknown
    "requires_grad",  # 1 / 0, -1 when unknown (msprobe's dumps say; ours record the batch instead)
]

_TEXT_COLUMNS = {"name", "module", "api", "direction", "role", "dtype", "shape", "stack", "tensor"}
_FLOAT_COLUMNS = {"min", "max", "mean", "norm", "nan_count", "inf_count"}

METRIC_COLUMNS = ("step", "loss", "grad_norm", "lr")  # one row per training step

# Every direction of a call, in the order a step runs them: its parameters, its data, forward, backward,
# the parameters' gradients autograd accumulated (a call of its own, made of `parameter_grad` records),
# the API calls after its backward outside the optimizer (clipping, as msprobe records them), the
# calls inside the optimizer's step (its arithmetic, as msprobe records it, op by op), and the
# optimizer's update of each parameter (ours: one `Optimizer.step` call per parameter).
DIRECTIONS = ("parameter", "data", "forward", "backward", "gradient", "update", "in_optimizer", "optimizer")

INPUT_ROLES = ("input", "grad_output")  # what flows into a call (forward / backward)
OUTPUT_ROLES = ("output", "grad_input")  # what flows out of it
PARAMETER_ROLES = ("parameter", "parameter_grad")  # used by report

# Frames from these packages are hook and dispatch machinery, not the user's call site.
_MACHINERY = ("/torch/", "/msprobe/", "/pi0align/dump/", "/torch_npu/")


@dataclass(frozen=True)
class TensorRecord:
    """What a record says of its full tensor: where it is stored (the `tensor` column) and what it
    must be there, which the readers check before reading it (sizes.py)."""

    step: int
    path: str
    shape: str  # as the records write it: `[2, 3]`
    dtype: str
    numel: int


@dataclass
class Dump:
    """One rank of one run, read from either format."""

    source: str
    mode: str  # "stats" | "sample" | "tensor"
    rank: int
    records: Table  # RECORD_COLUMNS
    metrics: Table  # step, loss, grad_norm, lr
    manifest: dict[str, Any]
    stacks: dict[tuple[int, int], Sequence[str]] = field(default_factory=dict)  # (step, call) -> frames
    # a record's full tensor -> array-like with .shape and slicing (h5py dataset, memmap), once
    # found to be what its record says (`tensor`)
    tensor_reader: Callable[[TensorRecord], Any] | None = None
    # (step) -> (values, positions) float64 / int32-or-int64 arrays, shape (n_records_of_step, sample_size)
    sample_reader: Callable[[int], tuple[np.ndarray, np.ndarray]] | None = None
    # (step, call) -> the call's non-tensor arguments as recorded (`calls/args` JSON), for replay
    args_reader: Callable[[int, int], str] | None = None
    notes: list[str] = field(default_factory=list)
    close: Callable[[], None] = lambda: None

    def tensor(self, record: int) -> Any:
        """The full tensor of record `record` (its row in `records`), read on demand; a file that
        stores another one is damaged, said in one line (UserError) before it is read."""
        records = self.records
        return self.tensor_reader(TensorRecord(
            step=int(records["step"][record]), path=str(records["tensor"][record]),
            shape=str(records["shape"][record]), dtype=str(records["dtype"][record]),
            numel=int(records["numel"][record])))


def subjects(names: np.ndarray) -> np.ndarray:
    """What each record name is about, without its API part (`<module>/<API>#k` -> the module path;
    `<parameter>/Parameter#0` and `<parameter>/Optimizer.step#0` -> the parameter; `<key>/Data#k`
    -> the batch's key)."""
    return mapped(names, lambda name: str(name).rpartition("/")[0])


def function_name(api: str) -> str:
    """The function an API names, what follows its last dot (`Functional.linear` -> `linear`,
    `Module.Linear` -> `Linear`)."""
    return str(api).rpartition(".")[2]


def function_names(apis: np.ndarray) -> np.ndarray:
    """function_name of each API."""
    return mapped(apis, function_name)


def no_records() -> Table:
    """A records table without rows, its columns of the types readers give them."""
    kind = lambda c: object if c in _TEXT_COLUMNS else np.float64 if c in _FLOAT_COLUMNS else np.int64
    return Table({c: np.zeros(0, kind(c)) for c in RECORD_COLUMNS})


def no_metrics() -> Table:
    """The training metrics of a dump that has none (msprobe's never do)."""
    return Table({c: np.zeros(0, object) for c in METRIC_COLUMNS})


def user_frames(frames: list[str] | tuple[str, ...]) -> list[str]:
    """The frames that are user code rather than hook machinery (all of them when none is)."""
    return list(_user_frames(tuple(frames)))


@functools.lru_cache(maxsize=1 << 16)  # many calls share one call site
def _user_frames(frames: tuple[str, ...]) -> tuple[str, ...]:
    kept = tuple(frame for frame in frames if not any(part in frame for part in _MACHINERY))
    return kept or frames


def call_site(frames: list[str] | tuple[str, ...]) -> str:
    """The innermost user frame ("" when there are no frames)."""
    kept = _user_frames(tuple(frames))
    return kept[-1] if kept else ""


def iter_flat_chunks(a: Any, b: Any, chunk_elements: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Equal flat float64 slices of two arrays of the same shape, about chunk_elements at a time.
    The slices are views of two buffers reused from chunk to chunk: use each before the next."""
    shape = tuple(a.shape)
    if len(shape) == 0:
        yield np.asarray(a[()], np.float64).reshape(1), np.asarray(b[()], np.float64).reshape(1)
        return
    row = int(np.prod(shape[1:], dtype=np.int64))
    rows = max(1, chunk_elements // max(row, 1))
    buffers = np.empty((2, min(rows, shape[0]) * row))
    for start in range(0, shape[0], rows):
        chunk_a, chunk_b = a[start:start + rows], b[start:start + rows]
        n = chunk_a.size
        np.copyto(buffers[0, :n], np.reshape(chunk_a, -1), casting="unsafe")
        np.copyto(buffers[1, :n], np.reshape(chunk_b, -1), casting="unsafe")
        yield buffers[0, :n], buffers[1, :n]


class Bfloat16Array:
    """Read view of bfloat16 stored as raw uint16 bits: slicing returns float32 values."""

    def __init__(self, bits: Any):
        self.bits, self.shape = bits, bits.shape

    def __getitem__(self, index: Any) -> np.ndarray:
        return self.decode(self.bits[index])

    @staticmethod
    def decode(bits: Any) -> np.ndarray:
        return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32)
