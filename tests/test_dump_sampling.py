"""Sample mode: positions depend only on a record's name, role, argument index and shape, so two
runs with different data sample the same elements; the values are those elements."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import require_native

from pi0align import Dumper
from pi0align.dump.backends.sample_rows import PositionTable, SampleRows
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


def ordered(table: PositionTable, samples: SampleRows) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What the writer process makes of a step's samples: values, positions, and the counts."""
    return *table.ordered(samples), samples.counts


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


@pytest.mark.parametrize("level", ["mix", "module"])
def test_the_native_gather_samples_what_torch_indexing_samples(tmp_path, level):
    """The native kernel's gather on the CPU, by the sampler at a layout's first sight and by the
    recorder itself at the next (queued at level mix, at once at level module, where in-place calls
    are not seen); torch indexing what an accelerator runs. Steps 1 and 4 repeat step 0's layouts;
    step 2 changes the batch's shape, step 3 its strides (a transposed view)."""
    require_native()
    generator = torch.Generator().manual_seed(3)
    inputs = [torch.randn(3, 4, generator=generator), torch.randn(3, 4, generator=generator),
              torch.randn(5, 4, generator=generator), torch.randn(4, 3, generator=generator).t(),
              torch.randn(3, 4, generator=generator)]
    for backend in ("torch", "native"):
        torch.manual_seed(1)
        train_steps(Net(), inputs, Dumper(tmp_path / backend, level=level, mode="sample", sample_size=SIZE,
                                          backend=backend))
    for step in range(len(inputs)):
        reference, dumped = (read_step(tmp_path / backend / "dump.h5", step) for backend in ("torch", "native"))
        assert np.array_equal(dumped["samples"]["positions"], reference["samples"]["positions"])
        assert np.array_equal(dumped["samples"]["values"], reference["samples"]["values"], equal_nan=True)
        assert dumped["records"]["sample_count"] == reference["records"]["sample_count"]


def test_the_recorder_s_own_gather_samples_what_the_sampler_does_as_its_table_grows():
    """Many records a step: the host table grows while the recorder gathers the layouts it knows
    (the second step: the first step's 300 again, in another order, beside 500 new ones), and
    only the new ones are handed to the sampler."""
    require_native()
    from pi0align.dump.backends.native_backend import NativeBackend
    from pi0align.dump.backends.sampling import Sampler

    class CountedSampler(Sampler):
        added = 0

        def add(self, *args) -> int:
            self.added += 1
            return super().add(*args)

    backend = NativeBackend.load()
    native, reference = CountedSampler(SIZE, backend.host_gather, queued=True), Sampler(SIZE)
    native_table, reference_table = PositionTable(), PositionTable()
    generator = torch.Generator().manual_seed(0)
    tensors = [torch.randn(2 + i % 7, 3 + i % 5, generator=generator) for i in range(800)]
    for names in (range(300), [*range(299, -1, -1), *range(300, 800)]):
        records = backend.records(True, None, native)
        rows = [records.record(0, f"t{i}", "input", 0, [tensors[i]]) for i in names]
        sample_rows = records.columns()["sample_row"][rows]
        records.statistics()
        got = ordered(native_table, native.collect(sample_rows))
        expected = ordered(reference_table, reference.collect(
            np.array([reference.add(tensors[i], f"t{i}", "input", 0) for i in names])))
        for column, want in zip(got, expected):
            assert np.array_equal(column, want, equal_nan=True)
    assert native.added == 300 + 500


def test_positions_are_int64_only_in_a_step_with_a_tensor_of_2_to_the_31_elements():
    from pi0align.dump.backends.sampling import Sampler

    sampler, table = Sampler(SIZE), PositionTable()
    small, wide = torch.arange(10.0), torch.ones(1).expand(2**31 + 7)  # a view: no memory
    for step_tensors in ([small], [small, wide], [small]):
        rows = [sampler.add(t, f"t{len(t)}", "input", 0) for t in step_tensors]
        values, positions, counts = ordered(table, sampler.collect(np.array([*rows, -1])))
        has_wide = len(step_tensors) == 2
        assert positions.dtype == (np.int64 if has_wide else np.int32)
        assert list(counts) == [SIZE] * len(step_tensors) + [0]
        assert np.array_equal(values[0], small.numpy()[positions[0]]) and np.isnan(values[-1]).all()
        assert (positions[-1] == -1).all()
        if has_wide:
            assert np.array_equal(positions[1], sample_positions(f"t{len(wide)}", "input", 0, tuple(wide.shape), SIZE))
            assert (values[1] == 1).all()


def test_a_dumper_closed_and_started_again_writes_every_step_s_positions(tmp_path, backend):
    """Each step hands the writer process only the positions it has not seen: a new writer
    process (after close()) is handed them all again."""
    torch.manual_seed(0)
    net, dumper = Net(), Dumper(tmp_path, level="mix", mode="sample", sample_size=SIZE, backend=backend)
    inputs = [torch.randn(3, 4), torch.randn(3, 4)]
    train_steps(net, inputs[:1], dumper)
    dumper.close()
    train_steps(net, inputs[1:], dumper)
    dumper.close()
    first, second = (read_step(tmp_path / "dump.h5", step) for step in (0, 1))
    assert first["calls"]["name"] == second["calls"]["name"]
    assert np.array_equal(first["samples"]["positions"], second["samples"]["positions"])
    row = find(second, "block.proj.weight/Parameter#0", "parameter", "parameter")
    assert np.array_equal(second["samples"]["positions"][row],
                          sample_positions("block.proj.weight/Parameter#0", "parameter", 0, (4, 4), SIZE))
