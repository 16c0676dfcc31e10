"""The fused CPU statistics kernel gives what the torch-op path gives (the format's statistics and
checksum), on every dtype it takes, on views read in place, with NaN and Inf, called through the
torch extension (observer.py) or, where that cannot be built, through ctypes; without a compiler
the dumper falls back to torch ops and says so."""

from __future__ import annotations

import gc
import math
import os
import time
import weakref

import h5py
import numpy as np
import pytest
import torch
from conftest import without_compiler

from pi0align import Dumper
from pi0align.dump import observer
from pi0align.dump.kernel import KERNEL, Kernel
from pi0align.dump.stats import ChecksumWeights, torch_stats
from pi0align.testing.dump_helpers import reference_checksum

pytestmark = pytest.mark.skipif(KERNEL.load() != "fused", reason=f"no fused kernel here ({KERNEL.status})")


@pytest.fixture(params=["extension", "ctypes"])
def kernel(request, monkeypatch) -> Kernel:
    """The process's kernel (through the extension), or one built where the extension cannot be."""
    if request.param == "extension":
        if KERNEL.observer is None:
            pytest.skip(f"the extension is not built here ({KERNEL.observer_status})")
        yield KERNEL
        return
    monkeypatch.setattr(observer, "SOURCE", "#error as without Python headers\n")
    ctypes_only = Kernel()
    assert ctypes_only.load() == "fused" and ctypes_only.observer_status.startswith("python: compiling")
    yield ctypes_only
    ctypes_only.wait()


def as_numbers(result: tuple) -> tuple:
    return tuple(0 if v is None else (v.item() if isinstance(v, torch.Tensor) else v) for v in result)


def fused_stats(kernel: Kernel, x: torch.Tensor, queued: bool = False) -> tuple:
    floats, ints = np.zeros(4), np.zeros(3, dtype=np.int64)
    kernel.stats(x, floats.ctypes.data, ints.ctypes.data, queued)
    kernel.wait()
    return (*floats.tolist(), *ints.tolist())


def assert_same_as_torch(kernel: Kernel, x: torch.Tensor) -> None:
    fused = fused_stats(kernel, x)
    reference = as_numbers(torch_stats(x, ChecksumWeights()))
    assert fused[4:] == reference[4:]  # NaN count, Inf count, checksum: exact
    assert fused[:2] == reference[:2]  # min and max: exact in any order
    assert fused[2:4] == pytest.approx(reference[2:4], rel=1e-5, abs=1e-6)  # sums: the order differs


def values(dtype: torch.dtype, numel: int, special: bool) -> torch.Tensor:
    generator = torch.Generator().manual_seed(numel)
    if dtype == torch.bool:
        return torch.rand(numel, generator=generator) > 0.5
    if not dtype.is_floating_point:
        low = 0 if dtype == torch.uint8 else -100
        return torch.randint(low, 100, (numel,), generator=generator, dtype=dtype)
    x = (torch.randn(numel, generator=generator, dtype=torch.float64) * 100).to(dtype)
    if special:
        x[numel // 3], x[numel // 2], x[-1] = math.nan, math.inf, -math.inf
    return x


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("numel", [1, 7, 4097, 100_003])
def test_fused_statistics_equal_the_torch_path(kernel, dtype, numel):
    assert_same_as_torch(kernel, values(dtype, numel, special=False))
    if dtype.is_floating_point and numel > 3:
        assert_same_as_torch(kernel, values(dtype, numel, special=True))


def test_checksum_follows_the_format_on_small_tensors(kernel):
    for dtype in DTYPES:
        x = values(dtype, 300, special=dtype.is_floating_point)
        assert fused_stats(kernel, x)[6] == reference_checksum(x)


def test_every_float16_value_converts_exactly(kernel):
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16)
    finite = x.double()[torch.isfinite(x)]
    lo, hi, total, _, nan, inf, _ = fused_stats(kernel, x)
    assert (lo, hi, total, nan, inf) == (finite.min().item(), finite.max().item(), finite.sum().item(), 2046, 2)


@pytest.mark.parametrize("view", [
    lambda b: b.permute(3, 1, 0, 2), lambda b: b.transpose(0, 1), lambda b: b[:, ::2], lambda b: b[..., 1],
    lambda b: b[:, :, None].expand(6, 5, 7, 4, 3), lambda b: b.flatten(1).t(),
    lambda b: b.permute(2, 0, 3, 1)[1:, :, ::2],
    lambda b: b[0, 0, 0, :1].expand(4, 4), lambda b: b.to(torch.bfloat16).transpose(1, 3),
])
def test_views_are_read_in_place_with_row_major_positions(kernel, view):
    base = torch.randn(6, 5, 4, 3, generator=torch.Generator().manual_seed(0))
    x = view(base)
    assert_same_as_torch(kernel, x)
    assert fused_stats(kernel, x)[6] == reference_checksum(x)
    with_nan = x.clone().transpose(0, -1).contiguous().transpose(0, -1)  # non-contiguous again
    with_nan[(0,) * x.dim()] = math.nan
    assert_same_as_torch(kernel, with_nan)


def test_more_dims_than_the_kernel_walks_are_read_from_a_contiguous_copy(kernel):
    x = torch.randn([2] * 18, generator=torch.Generator().manual_seed(0)).transpose(0, 17)
    assert_same_as_torch(kernel, x)
    assert fused_stats(kernel, x)[6] == reference_checksum(x)


def test_empty_tensor(kernel):
    assert fused_stats(kernel, torch.empty(0)) == (math.inf, -math.inf, 0.0, 0.0, 0, 0, 0)


def test_without_a_compiler_the_torch_path_runs_and_the_file_says_so(tmp_path, monkeypatch):
    without_compiler(tmp_path, monkeypatch)
    kernel = Kernel()
    for module in ("stats", "dumper", "capture"):
        monkeypatch.setattr(f"pi0align.dump.{module}.KERNEL", kernel)
    x = torch.tensor([1.0, -2.0, math.nan])
    with Dumper(tmp_path / "dump", steps=[0], level="api") as dumper:
        dumper.start()
        x * 2
        dumper.step()
    assert kernel.status.startswith("torch ops:") and not kernel.supports(x)
    with h5py.File(dumper.file, "r") as f:
        assert f.attrs["cpu_stats"] == kernel.status and f.attrs["observer"].startswith("python: ")
        records = f["steps/000000/records"]
        assert (records["min"][0], records["max"][0], records["nan_count"][0]) == (-2.0, 1.0, 1)
        assert records["checksum"][0] == reference_checksum(x)


def test_queued_statistics_and_samples_equal_those_computed_at_once(kernel):
    tensors = [values(dtype, numel, special=dtype.is_floating_point)
               for dtype in DTYPES for numel in (1, 300, 4097, 100_003)]
    tensors += [t.t() for t in (torch.randn(300, 70), torch.randn(5, 4097))]
    floats, ints = np.zeros((len(tensors), 4)), np.zeros((len(tensors), 3), dtype=np.int64)
    offsets = np.array([0, 2, 1, 0], dtype=np.int64)
    samples = np.zeros((len(tensors), len(offsets)))
    for i, x in enumerate(tensors):
        kernel.stats(x, floats[i].ctypes.data, ints[i].ctypes.data, queued=True)
        kernel.gather(x, offsets.ctypes.data, len(offsets) if x.numel() >= 3 else 1, samples[i].ctypes.data,
                      queued=True)
    kernel.wait()
    for i, x in enumerate(tensors):
        assert (*floats[i].tolist(), *ints[i].tolist()) == fused_stats(kernel, x)
        at_once = np.zeros(len(offsets))
        kernel.gather(x, offsets.ctypes.data, len(offsets) if x.numel() >= 3 else 1, at_once.ctypes.data)
        assert np.array_equal(samples[i], at_once, equal_nan=True)


def test_queued_tensors_are_let_go_once_their_statistics_are_taken(kernel):
    """A step's temporaries must not live until its end because their statistics were queued."""
    rounds, calls_per_round = 200, 64  # the kernel looks at which calls have run once per 64
    out = np.zeros((1 + rounds * calls_per_round, 7))
    x = torch.randn(1000)
    alive = weakref.ref(x)
    kernel.stats(x, out[0].ctypes.data, out[0, 4:].ctypes.data, queued=True)
    del x
    queued = 1
    for _ in range(rounds):  # more queued calls, until the kernel's thread has run the first
        for row in range(queued, queued + calls_per_round):
            kernel.stats(torch.ones(10), out[row].ctypes.data, out[row, 4:].ctypes.data, queued=True)
        queued += calls_per_round
        gc.collect()
        if alive() is None:
            break
        time.sleep(0.001)  # a loaded machine may not have scheduled the kernel's thread yet
    assert alive() is None and kernel.held() < queued
    kernel.wait()
    assert kernel.held() == 0 and (out[1:queued, 2] == 10).all()


def test_a_forked_child_queues_on_its_own_thread(kernel):
    """The parent's kernel thread does not exist in a forked child (a DataLoader worker, say)."""
    fused_stats(kernel, torch.ones(3), queued=True)  # the parent's thread is running
    pending = np.zeros(7)
    kernel.stats(torch.ones(10), pending.ctypes.data, pending[4:].ctypes.data, queued=True)  # not waited for
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.write(write, b"ok" if fused_stats(kernel, torch.arange(4.0), queued=True)[2] == 6.0 else b"no")
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    assert os.read(read, 2) == b"ok"
    kernel.wait()
    assert pending[2] == 10
