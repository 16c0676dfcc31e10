"""The dump file's format (docs/dump-format.md): its columns and their types, the checksum and the
sample positions, defined once for the writer (dump_file.py), the reader
(compare/reading/read_ours.py) and the test factory. Imports neither torch, nor h5py (a compare of
msprobe dumps reads it), nor the rest of pi0align."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

FORMAT = "pi0align-dump"
VERSION = 1
# the API of the optimizer's update of one parameter, a call of its own (`<parameter>/Optimizer.step#0`)
OPTIMIZER_API = "Optimizer.step"
# the functions (the last part of an API's name) whose results are drawn from a random generator:
# a replay cannot draw the same numbers, and a comparison counts a draw that differs beyond the
# rounding of its transform as data (another generator state or seed), not a faulty kernel
RANDOM_FUNCTIONS = frozenset(
    "dropout dropout1d dropout2d dropout3d alpha_dropout feature_alpha_dropout rrelu rrelu_ "
    "rand rand_like randn randn_like randint randint_like randperm normal normal_ uniform_ "
    "bernoulli bernoulli_ multinomial exponential_ geometric_ cauchy_ log_normal_ random_ poisson "
    "_standard_gamma _sample_dirichlet binomial native_dropout gumbel_softmax".split())
# the root attributes' values: what a dump records, at which level, with which backend
MODES = ("stats", "sample", "tensor")
LEVELS = ("api", "module", "mix")
BACKENDS = ("native", "torch")

# h5py's variable-length UTF-8 string, spelt as `h5py.string_dtype("utf-8")` makes it (a test checks)
STR = np.dtype("O", metadata={"vlen": str})
CALL_TYPES = {
    "call_id": np.int32, "seq": np.int64, "name": STR, "module": STR, "api": STR,
    "direction": STR, "stack_id": np.int32, "args": STR,
}
RECORD_TYPES = {
    "call_id": np.int32, "role": STR, "arg_index": np.int32, "dtype": STR, "shape": STR,
    "numel": np.int64, "min": np.float64, "max": np.float64, "mean": np.float64, "norm": np.float64,
    "nan_count": np.int64, "inf_count": np.int64, "checksum": np.int64, "sample_count": np.int32,
    "tensor": STR, "skipped": STR,
}
METRIC_TYPES = {"step": np.int64, "loss": np.float64, "grad_norm": np.float64, "lr": np.float64}
# How `calls/args` names a device: torch.device's repr as {"repr": ...}, or a device string. A
# replay runs on the CPU and a comparison sets devices aside: both read them with these patterns.
DEVICE_REPR = r"device\(type='[a-z]+'(, index=\d+)?\)"
DEVICE_NAME = r"(cpu|cuda|npu|xpu|mps)(:\d+)?"


def checksum(elements: np.ndarray) -> int:
    """The records' `checksum` of an array in row-major order: Σ bits × (position + 1), the bits of
    each element read as an integer of its width (unsigned for 1 byte, signed for 2, 4 and 8),
    wrapping at 32 bits (64 for 8-byte elements), sign-extended. The dump backends compute the same
    on the device; the test factory and tests use this one."""
    flat = np.ascontiguousarray(elements).reshape(-1)
    width = flat.itemsize
    bits = flat.view({1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}[width]).astype(np.int64).view(np.uint64)
    total = int(np.sum(bits * np.arange(1, flat.size + 1, dtype=np.uint64), dtype=np.uint64))  # wraps at 2^64
    modulus = 1 << (64 if width == 8 else 32)
    total %= modulus
    return total - modulus if total >= modulus // 2 else total


def sample_positions(name: str, role: str, arg_index: int, shape: tuple[int, ...], size: int) -> np.ndarray:
    """Sample mode's sorted flat (row-major) positions, which depend only on a record's name, role,
    argument index and shape, so that two runs on two devices sample the same elements: every
    element when there are at most `size`."""
    numel = int(np.prod(shape, dtype=np.int64))
    if numel <= size:
        return np.arange(numel, dtype=np.int64)
    import hashlib  # here: a compare of statistics never samples and does not pay for OpenSSL's load

    key = f"{name}|{role}|{arg_index}|{list(shape)}".encode()
    seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
    return np.sort(np.random.default_rng(seed).choice(numel, size=size, replace=False)).astype(np.int64)


def step_group(step: int) -> str:
    return f"steps/{step:06d}"


def tensors_file(dump: Path, step: int) -> str:
    """Where a step's full tensors go (tensor mode), relative to the dump file's folder."""
    return f"{dump.name}.tensors/{step:06d}.h5"


@dataclass
class StepTables:
    """A finished step, host-side, in the column names of docs/dump-format.md."""

    step: int
    calls: dict[str, np.ndarray]
    records: dict[str, np.ndarray]
    samples: tuple[np.ndarray, np.ndarray] | None  # (values, positions) in sample mode
