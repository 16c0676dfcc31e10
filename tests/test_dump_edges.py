"""Edge tensors (NaN/Inf, empty, integer, bool, complex, sparse, meta, subclasses) are recorded or
skipped with a reason, never a crash; tensor mode stores bfloat16 and float16 losslessly; on both
dump backends."""

from __future__ import annotations

import math

import h5py
import hdf5plugin
import numpy as np
import pytest
import torch
from test_dump_statistics import VIEWS

from pi0align import Dumper
from pi0align.testing.dump_helpers import find, read_step, reference_checksum

torch.set_num_threads(1)


class Tagged(torch.Tensor):
    pass


@pytest.fixture(scope="module")
def edges(tmp_path_factory, backend):
    path = tmp_path_factory.mktemp("edges")
    special = torch.tensor([1.0, math.nan, math.inf, -math.inf, 2.0])
    with Dumper(path, steps=[0], level="api", backend=backend) as dumper:
        dumper.start()
        torch.abs(special)
        torch.zeros(0) + 1
        torch.arange(5) * 3
        torch.tensor([True, False]) & torch.tensor([True, True])
        torch.complex(torch.ones(2), torch.zeros(2))
        torch.eye(3).to_sparse() * 2
        torch.empty(3, device="meta") + 1
        torch.ones(2).as_subclass(Tagged) * 2
        ones = torch.ones(3)
        ones[1:] = 5  # in place: the input is recorded before the call, the output after
        dumper.step()
    return read_step(path / "dump.h5", 0)


def test_nan_and_inf_are_counted_and_left_out_of_the_other_statistics(edges):
    records = edges["records"]
    row = find(edges, "/Torch.abs#0", "forward", "input")
    assert (records["nan_count"][row], records["inf_count"][row]) == (1, 2)
    assert (records["min"][row], records["max"][row], records["mean"][row]) == (1.0, 2.0, 1.5)
    assert records["norm"][row] == pytest.approx(math.sqrt(5))
    assert records["checksum"][row] == reference_checksum(torch.tensor([1.0, math.nan, math.inf, -math.inf, 2.0]))
    assert records["skipped"][row] == ""


def test_empty_integer_bool_complex_sparse_meta_and_subclass_tensors(edges):
    records = edges["records"]

    def skipped(name, role="input", arg=0):
        return records["skipped"][find(edges, name, "forward", role, arg)]

    assert skipped("/Tensor.add#0") == "empty" and skipped("/Tensor.add#0", "output") == "empty"
    row = find(edges, "/Tensor.mul#0", "forward", "output")
    statistics = (records["dtype"][row], records["min"][row], records["max"][row], records["mean"][row])
    assert statistics == ("int64", 0, 12, 6)
    assert records["checksum"][row] == reference_checksum(torch.arange(5) * 3)
    row = find(edges, "/Tensor.__and__#0", "forward", "output")
    assert (records["dtype"][row], records["mean"][row], records["skipped"][row]) == ("bool", 0.5, "")
    assert skipped("/Torch.complex#0", "output") == "complex"
    assert skipped("/Tensor.mul#1") == "sparse"
    assert skipped("/Tensor.add#1") == "meta"
    assert skipped("/Tensor.mul#2") == "subclass:Tagged"
    assert all(math.isnan(records["norm"][i]) for i, s in enumerate(records["skipped"]) if s)


def test_in_place_calls_record_their_input_before_and_output_after(edges):
    records = edges["records"]
    before = find(edges, "/Tensor.__setitem__#0", "forward", "input", 0)
    after = find(edges, "/Tensor.__setitem__#0", "forward", "output", 0)
    assert (records["mean"][before], records["mean"][after]) == (1.0, 11 / 3)


def test_batch_norm_running_statistics_are_recorded_before_the_call_updates_them(tmp_path, backend):
    """F.batch_norm updates its running_mean argument in place, without a trailing underscore."""
    norm = torch.nn.BatchNorm1d(4)
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(0)) + 3
    with Dumper(tmp_path, steps=[0], level="api", backend=backend) as dumper:
        dumper.start()
        norm(x)
        dumper.step()
    step = read_step(tmp_path / "dump.h5", 0)
    running_mean = find(step, "/Functional.batch_norm#0", "forward", "input", 1)
    assert step["records"]["mean"][running_mean] == 0.0  # as it went in, not as the call left it
    assert norm.running_mean.mean().item() > 0.1


def test_tensor_mode_stores_low_precision_tensors_losslessly(tmp_path, backend):
    a = torch.randn(4, 8).to(torch.bfloat16)
    b = torch.randn(4, 8).to(torch.float16)
    big = torch.randn(300, 4000).to(torch.bfloat16)  # large enough to be compressed, in several chunks
    with Dumper(tmp_path, steps=[0], level="api", mode="tensor", backend=backend) as dumper:
        dumper.start()
        a * 2
        b.t() * 2
        big.t() * 2
        dumper.step()
    tables = read_step(tmp_path / "dump.h5", 0)
    with h5py.File(tmp_path / "dump.h5", "r") as f:
        group = f["steps/000000"]
        stored = group[tables["records"]["tensor"][find(tables, "/Tensor.mul#0", "forward", "input")]]
        assert stored.attrs["dtype"] == "bfloat16" and stored.dtype == np.uint16
        assert torch.equal(torch.from_numpy(stored[()].view(np.int16)).view(torch.bfloat16), a)
        stored = group[tables["records"]["tensor"][find(tables, "/Tensor.mul#1", "forward", "input")]]
        assert stored.attrs["dtype"] == "float16" and np.array_equal(stored[()], b.t().numpy())
        stored = group[tables["records"]["tensor"][find(tables, "/Tensor.mul#2", "forward", "input")]]
        assert set(stored._filters) == {"shuffle", str(hdf5plugin.ZSTD_ID)} and stored.chunks[0] < 4000
        assert torch.equal(torch.from_numpy(stored[()].view(np.int16)).view(torch.bfloat16), big.t())


@pytest.mark.parametrize("view", VIEWS)
def test_tensor_mode_stores_a_view_s_elements_in_row_major_order_as_they_were(tmp_path, backend, view):
    """A view is copied for the writer element by element (the native backend: on its own thread),
    before an in-place call on its base changes it."""
    base = torch.randn(6, 5, 4, 3, generator=torch.Generator().manual_seed(0))
    x = view(base)
    expected = x.clone()
    with Dumper(tmp_path, steps=[0], level="api", mode="tensor", backend=backend) as dumper:
        dumper.start()
        torch.neg(x)
        base.add_(1.0)
        dumper.step()
    tables = read_step(tmp_path / "dump.h5", 0)
    with h5py.File(tmp_path / "dump.h5", "r") as f:
        stored = f["steps/000000"][tables["records"]["tensor"][find(tables, "/Torch.neg#0", "forward", "input")]][()]
    if x.dtype == torch.bfloat16:
        stored = torch.from_numpy(stored.view(np.int16)).view(torch.bfloat16)
    assert torch.equal(torch.as_tensor(stored), expected)


def test_tensor_mode_stores_a_view_of_more_dims_than_the_native_kernel_walks(tmp_path, backend):
    x = torch.randn([2] * 18, generator=torch.Generator().manual_seed(0)).transpose(0, 17)
    with Dumper(tmp_path, steps=[0], level="api", mode="tensor", backend=backend) as dumper:
        dumper.start()
        torch.neg(x)
        dumper.step()
    tables = read_step(tmp_path / "dump.h5", 0)
    with h5py.File(tmp_path / "dump.h5", "r") as f:
        stored = f["steps/000000"][tables["records"]["tensor"][find(tables, "/Torch.neg#0", "forward", "input")]][()]
    assert torch.equal(torch.from_numpy(stored), x)


def test_tensor_mode_stores_each_tensor_as_it_was_when_recorded(tmp_path, backend):
    """Tensors changed in place after they were recorded (the native backend copies them for the
    writer on its own thread): each stored tensor holds the values of its record, not later ones;
    a temporary freed at once is stored too."""
    x = torch.full((300, 400), 1.0)
    with Dumper(tmp_path, steps=[0], level="api", mode="tensor", backend=backend) as dumper:
        dumper.start()
        y = x * 2
        y.add_(1)  # its input is y as the mul left it; the mul's output must stay 2s
        y[0] = 7  # and again
        torch.exp(x * 0).sum()  # temporaries, freed as soon as the next call has run
        dumper.step()
    tables = read_step(tmp_path / "dump.h5", 0)
    with h5py.File(tmp_path / "dump.h5", "r") as f:
        group = f["steps/000000"]

        def stored(name, role):
            return group[tables["records"]["tensor"][find(tables, name, "forward", role)]][()]

        assert (stored("/Tensor.mul#0", "output") == 2).all() and (stored("/Tensor.add_#0", "input") == 2).all()
        assert (stored("/Tensor.add_#0", "output") == 3).all()
        after = stored("/Tensor.__setitem__#0", "output")
        assert (after[0] == 7).all() and (after[1:] == 3).all()
        assert (stored("/Tensor.__setitem__#0", "input") == 3).all()
        assert (stored("/Torch.exp#0", "output") == 1).all() and stored("/Tensor.sum#0", "output") == 300 * 400


def test_torch_npu_fused_ops_are_captured_once_and_restored(tmp_path, monkeypatch, backend):
    # No Ascend NPU here: a stand-in torch_npu module with one fused op exercises the wrapping.
    import sys
    import types

    fake = types.ModuleType("torch_npu")

    def npu_scale(x, factor):
        return torch.mul(x, factor)

    fake.npu_scale = npu_scale
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    x = torch.ones(3, requires_grad=True)
    with Dumper(tmp_path, steps=[0], level="api", backend=backend) as dumper:
        dumper.start()
        fake.npu_scale(x, 2.0).sum().backward()
        dumper.step()
    assert fake.npu_scale is npu_scale
    tables = read_step(tmp_path / "dump.h5", 0)
    calls = list(zip(tables["calls"]["name"], tables["calls"]["direction"]))
    assert calls == [("/NPU.npu_scale#0", "forward"), ("/Tensor.sum#0", "forward"), ("/Tensor.sum#0", "backward"),
                     ("/NPU.npu_scale#0", "backward")]
    assert tables["records"]["mean"][find(tables, "/NPU.npu_scale#0", "forward", "output")] == 2.0
    assert tables["records"]["mean"][find(tables, "/NPU.npu_scale#0", "backward", "grad_input")] == 2.0
