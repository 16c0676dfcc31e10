"""Sample mode: positions depend only on a record's name, role, argument index and shape, so two
runs with different data sample the same elements; the values are those elements."""

from __future__ import annotations

import numpy as np
import torch
from conftest import require_native

from pi0align import Dumper
from pi0align.dump.file_format import sample_positions
from pi0align.testing.dump_helpers import Net, find, read_step, train_steps

torch.set_num_threads(1)
SIZE = 5


def dump(path, seed: int, backend: str) -> tuple[dict, dict]:
    torch.manual_seed(seed)
    net = Net()
    params = {name: p.detach().clone() for name, p in net.named_parameters()}
    train_steps(net, [torch.randn(3, 4) * seed], Dumper(path, steps=[0], level="mix", mode="sample", sample_size=SIZE,
                                                                     backend=backend))
    return read_step(path / "dump.h5", 0), params


def test_two_runs_with_different_data_sample_the_same_positions(tmp_path, backend):
    (first, params), (second, _) = dump(tmp_path / "a", 1, backend), dump(tmp_path / "b", 2, backend)
    assert first["calls"]["name"] == second["calls"]["name"]
    assert np.array_equal(first["samples"]["positions"], second["samples"]["positions"])
    assert first["samples"]["positions"].dtype == np.int32  # every tensor here has fewer than 2**31 elements
    assert first["records"]["sample_count"] == second["records"]["sample_count"]
    assert not np.array_equal(first["samples"]["values"], second["samples"]["values"], equal_nan=True)
    counts = np.array(first["records"]["sample_count"])
    numel = np.array(first["records"]["numel"])
    assert np.array_equal(counts, np.minimum(numel, SIZE))
    assert (numel > SIZE).any() and (numel <= SIZE).any()

    row = find(first, "block.proj.weight/Parameter#0", "parameter", "parameter")
    positions = first["samples"]["positions"][row]
    assert np.array_equal(positions, sample_positions("block.proj.weight/Parameter#0", "parameter", 0, (4, 4), SIZE))
    assert len(set(positions)) == SIZE and list(positions) == sorted(positions)
    expected = params["block.proj.weight"].reshape(-1)[torch.from_numpy(positions)].double().numpy()
    assert np.array_equal(first["samples"]["values"][row], expected)
    small = find(first, "head.bias/Parameter#0", "parameter", "parameter")  # 2 elements: all, in order
    assert list(first["samples"]["positions"][small][:2]) == [0, 1]
    assert np.isnan(first["samples"]["values"][small][2:]).all()


def test_positions_change_with_name_role_argument_and_shape():
    base = sample_positions("m/Torch.add#0", "input", 0, (100,), SIZE)
    assert np.array_equal(base, sample_positions("m/Torch.add#0", "input", 0, (100,), SIZE))
    for other in (("m/Torch.add#1", "input", 0, (100,)), ("m/Torch.add#0", "output", 0, (100,)),
                  ("m/Torch.add#0", "input", 1, (100,)), ("m/Torch.add#0", "input", 0, (10, 10))):
        assert not np.array_equal(base, sample_positions(*other, SIZE))


def test_the_native_gather_samples_what_torch_indexing_samples(tmp_path):
    """The native kernel's gather on the CPU; torch indexing what an accelerator runs."""
    require_native()
    reference, _ = dump(tmp_path / "torch", 1, "torch")
    dumped, _ = dump(tmp_path / "native", 1, "native")
    assert np.array_equal(dumped["samples"]["positions"], reference["samples"]["positions"])
    assert np.array_equal(dumped["samples"]["values"], reference["samples"]["values"], equal_nan=True)


def test_positions_are_int64_only_in_a_step_with_a_tensor_of_2_to_the_31_elements():
    from pi0align.dump.sampling import Sampler

    sampler = Sampler(SIZE)
    small, wide = torch.arange(10.0), torch.ones(1).expand(2**31 + 7)  # a view: no memory
    for step_tensors in ([small], [small, wide], [small]):
        rows = [sampler.add(t, f"t{len(t)}", "input", 0) for t in step_tensors]
        values, positions, counts = sampler.collect(np.array([*rows, -1]))
        has_wide = len(step_tensors) == 2
        assert positions.dtype == (np.int64 if has_wide else np.int32)
        assert list(counts) == [SIZE] * len(step_tensors) + [0]
        assert np.array_equal(values[0], small.numpy()[positions[0]]) and np.isnan(values[-1]).all()
        assert (positions[-1] == -1).all()
        if has_wide:
            assert np.array_equal(positions[1], sample_positions(f"t{len(wide)}", "input", 0, tuple(wide.shape), SIZE))
            assert (values[1] == 1).all()
