"""Both dump backends' statistics are the format's (docs/dump-format.md), on every dtype, on views,
with NaN and Inf, one tensor alone or many reduced together; the native kernel's queue keeps and
lets go of tensors as it should; without a compiler `auto` runs the torch backend and says why."""

from __future__ import annotations

import gc
import math
import os
import subprocess
import sys
import time
import weakref

import numpy as np
import pytest
import torch
from conftest import REPO, require_native

from pi0align.dump.backends.backend import choose_backend
from pi0align.dump.file_format import checksum
from pi0align.native import Library
from pi0align.testing.dump_helpers import reference_checksum

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool]


def values(dtype: torch.dtype, numel: int, special: bool) -> torch.Tensor:
    generator = torch.Generator().manual_seed(numel)
    if dtype == torch.bool:
        return torch.rand(numel, generator=generator) > 0.5
    if not dtype.is_floating_point:
        low = 0 if dtype == torch.uint8 else -100
        return torch.randint(low, 100, (numel,), generator=generator, dtype=dtype)
    x = (torch.randn(numel, generator=generator, dtype=torch.float64) * 100).to(dtype)
    if special and numel > 3:
        x[numel // 3], x[numel // 2], x[-1] = math.nan, math.inf, -math.inf
    return x


def statistics(backend: str, tensors: list[torch.Tensor], in_place_seen: bool = True) -> list[tuple]:
    """(min, max, mean, norm, NaN count, Inf count, checksum) of each tensor, recorded in one step."""
    records = choose_backend(backend).records(in_place_seen, None, None)
    for i, tensor in enumerate(tensors):
        records.record(i, f"t{i}", "input", 0, [tensor])
    floats, ints = records.statistics()
    return [(*f, *i) for f, i in zip(floats.tolist(), ints.tolist())]


def expected(tensor: torch.Tensor) -> tuple:
    """The format's statistics, from float64 numpy."""
    x = tensor.detach().double().reshape(-1).numpy() if tensor.dtype != torch.bool else tensor.reshape(-1).numpy()
    x = x.astype(np.float64)
    finite = x[np.isfinite(x)]
    return (finite.min(), finite.max(), finite.mean(), np.sqrt(np.sum(finite * finite)), int(np.isnan(x).sum()),
            int(np.isinf(x).sum()), reference_checksum(tensor))


def assert_format_statistics(found: tuple, tensor: torch.Tensor) -> None:
    want = expected(tensor)
    assert found[4:] == want[4:]  # NaN count, Inf count, checksum: exact
    assert found[:2] == want[:2]  # min and max: exact in any order
    scale = float(np.abs(tensor.double().nan_to_num(0, 0, 0).numpy()).max()) or 1.0
    assert found[2] == pytest.approx(want[2], rel=1e-5, abs=1e-6 * scale)  # sums: the order differs
    assert found[3] == pytest.approx(want[3], rel=1e-5)


@pytest.mark.parametrize("numel", [1, 7, 4097, 100_003])
def test_every_dtype_alone_and_reduced_together(backend, numel):
    tensors = [values(dtype, numel, special) for dtype in DTYPES for special in (False, True)
               if special <= dtype.is_floating_point]
    for tensor, found in zip(tensors, statistics(backend, tensors)):
        assert_format_statistics(found, tensor)
    for tensor in tensors[:3]:
        assert_format_statistics(statistics(backend, [tensor], in_place_seen=False)[0], tensor)


def test_groups_longer_than_one_window_of_the_integer_sums(backend):
    """The torch backend's prefix sums run a window of 2^20 elements at a time."""
    tensors = [values(torch.bfloat16, n, special=True) for n in (700_001, 5, 900_000, 1 << 20)]
    for tensor, found in zip(tensors, statistics(backend, tensors)):
        assert_format_statistics(found, tensor)


def test_checksum_is_the_format_module_s_on_small_tensors(backend):
    tensors = [values(dtype, 300, special=dtype.is_floating_point) for dtype in DTYPES]
    for tensor, found in zip(tensors, statistics(backend, tensors)):
        assert found[6] == reference_checksum(tensor) == checksum(tensor.view(torch.uint8).numpy().view(
            {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}[tensor.element_size()]))


def test_every_float16_value_converts_exactly(backend):
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16)
    finite = x.double()[torch.isfinite(x)]
    lo, hi, mean, _, nan, inf, _ = statistics(backend, [x])[0]
    assert (lo, hi, nan, inf) == (finite.min().item(), finite.max().item(), 2046, 2)
    assert mean == pytest.approx(finite.mean().item(), abs=1e-6 * 65504)


# Views of a (6, 5, 4, 3) tensor the kernels read in place: permuted, strided, repeated (expand)
VIEWS = [
    lambda b: b.permute(3, 1, 0, 2), lambda b: b.transpose(0, 1), lambda b: b[:, ::2], lambda b: b[..., 1],
    lambda b: b[:, :, None].expand(6, 5, 7, 4, 3), lambda b: b.flatten(1).t(),
    lambda b: b.permute(2, 0, 3, 1)[1:, :, ::2],
    lambda b: b[0, 0, 0, :1].expand(4, 4), lambda b: b.to(torch.bfloat16).transpose(1, 3),
]


@pytest.mark.parametrize("view", VIEWS)
def test_views_have_the_statistics_of_their_row_major_elements(backend, view):
    base = torch.randn(6, 5, 4, 3, generator=torch.Generator().manual_seed(0))
    x = view(base)
    with_nan = x.clone().transpose(0, -1).contiguous().transpose(0, -1)  # non-contiguous again
    with_nan[(0,) * x.dim()] = math.nan
    for tensor, found in zip((x, with_nan), statistics(backend, [x, with_nan])):
        assert_format_statistics(found, tensor)


def test_more_dims_than_the_native_kernel_walks(backend):
    x = torch.randn([2] * 18, generator=torch.Generator().manual_seed(0)).transpose(0, 17)
    assert_format_statistics(statistics(backend, [x])[0], x)


def test_a_tensor_changed_in_place_keeps_the_statistics_it_had_when_recorded(backend):
    x = torch.ones(10)
    records = choose_backend(backend).records(True, None, None)
    records.record(0, "x", "input", 0, [x])
    records.before_change([x[2:]])  # a view of it: the same memory
    x.mul_(3)
    records.record(1, "x", "output", 0, [x])
    floats, _ = records.statistics()
    assert floats[:, 0].tolist() == [1.0, 3.0]


# ---- the native kernel's own queue ---------------------------------------------------------------


@pytest.fixture
def kernel():
    """The native backend's extension module: its `stats`, `gather`, `wait` and `held`."""
    module = require_native().module
    yield module
    module.wait()


def native_stats(kernel, x: torch.Tensor, queued: bool = False) -> tuple:
    floats, ints = np.zeros(4), np.zeros(3, dtype=np.int64)
    kernel.stats(x, floats.ctypes.data, ints.ctypes.data, queued)
    kernel.wait()
    return (*floats.tolist(), *ints.tolist())


def test_queued_statistics_and_samples_equal_those_computed_at_once(kernel):
    tensors = [values(dtype, numel, special=dtype.is_floating_point)
               for dtype in DTYPES for numel in (1, 300, 4097, 100_003)]
    tensors += [t.t() for t in (torch.randn(300, 70), torch.randn(5, 4097))]
    floats, ints = np.zeros((len(tensors), 4)), np.zeros((len(tensors), 3), dtype=np.int64)
    offsets = np.array([0, 2, 1, 0], dtype=np.int64)
    samples = np.zeros((len(tensors), len(offsets)))
    for i, x in enumerate(tensors):
        kernel.stats(x, floats[i].ctypes.data, ints[i].ctypes.data, True)
        kernel.gather(x, offsets.ctypes.data, len(offsets) if x.numel() >= 3 else 1, samples[i].ctypes.data, True)
    kernel.wait()
    for i, x in enumerate(tensors):
        assert (*floats[i].tolist(), *ints[i].tolist()) == native_stats(kernel, x)
        at_once = np.zeros(len(offsets))
        kernel.gather(x, offsets.ctypes.data, len(offsets) if x.numel() >= 3 else 1, at_once.ctypes.data, False)
        assert np.array_equal(samples[i], at_once, equal_nan=True)


def test_a_queued_tensor_is_let_go_at_the_next_queued_call_once_its_statistics_are_taken(kernel):
    """A step's temporaries must not live until its end, nor many calls longer, because their
    statistics were queued: the heap would grow by them, and be given back, at every step."""
    out = np.zeros((2, 7))
    x = torch.randn(1 << 20)  # enough elements to wake the kernel's thread at once
    alive = weakref.ref(x)
    before = kernel.finished()
    kernel.stats(x, out[0].ctypes.data, out[0, 4:].ctypes.data, True)
    del x
    deadline = time.monotonic() + 30
    while kernel.finished() == before and time.monotonic() < deadline:
        time.sleep(0.001)  # a loaded machine may not have scheduled the kernel's thread yet
    gc.collect()
    assert kernel.finished() > before and alive() is not None  # run, and kept until a look at which have
    kernel.stats(torch.ones(10), out[1].ctypes.data, out[1, 4:].ctypes.data, True)
    gc.collect()
    assert alive() is None
    kernel.wait()
    assert kernel.held() == 0 and out[1, 2] == 10


def test_a_forked_child_queues_on_its_own_thread(kernel):
    """The parent's kernel thread does not exist in a forked child (a DataLoader worker, say)."""
    native_stats(kernel, torch.ones(3), queued=True)  # the parent's thread is running
    pending = np.zeros(7)
    kernel.stats(torch.ones(10), pending.ctypes.data, pending[4:].ctypes.data, True)  # not waited for
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.write(write, b"ok" if native_stats(kernel, torch.arange(4.0), queued=True)[2] == 6.0 else b"no")
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    assert os.read(read, 2) == b"ok"
    kernel.wait()
    assert pending[2] == 10


# ---- building -------------------------------------------------------------------------------------

WITHOUT_COMPILER = """
import sys, h5py, torch
from pi0align import Dumper
from pi0align.errors import UserError
try:
    Dumper(sys.argv[1] + "/native", backend="native")
except UserError as error:
    print("native:", error)
with Dumper(sys.argv[1] + "/auto", steps=[0], level="api") as dumper:
    dumper.start()
    torch.tensor([1.0, -2.0]) * 2
    dumper.step()
with h5py.File(dumper.file) as f:
    print("auto:", f.attrs["backend"], "|", f.attrs["backend_status"], "|", f["steps/000000/records/min"][0])
"""


def test_without_a_compiler_auto_runs_the_torch_backend_and_the_file_says_why(tmp_path):
    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler"), "PI0ALIGN_CACHE": str(tmp_path / "cache")}
    result = subprocess.run([sys.executable, "-c", WITHOUT_COMPILER, str(tmp_path)], capture_output=True, text=True,
                            env=env, cwd=REPO, timeout=300, check=True)
    native, auto = result.stdout.splitlines()
    assert native.startswith("native: the native dump backend cannot be built here: ") and "no-such-compiler" in native
    backend, status, lowest = auto.removeprefix("auto: ").split(" | ")
    assert backend == "torch" and "no-such-compiler" in status and float(lowest) == -2.0  # of the input


def test_a_compiler_error_names_the_source_file_and_line(tmp_path):
    source = tmp_path / "broken.cpp"
    source.write_text('extern "C" void f() {}\n\nint g() { return undeclared; }\n')
    library = Library("broken", [source], {"f": []})
    assert not library.load()
    assert f"{source}:3" in library.error and "undeclared" in library.error
