"""The writer process: tensors and steps handed over through the shared ring come back exact, when
the ring wraps and fills (the training side waits) and when one is larger than the ring."""

from __future__ import annotations

import os

import h5py
import hdf5plugin  # noqa: F401 - the tensors' Zstandard filter
import numpy as np
import pytest
import torch

from pi0align import Dumper
from pi0align.dump.backends.native_backend import NativeBackend
from pi0align.dump.backends.sample_rows import PositionTable, SampleRows
from pi0align.dump.writing import dump_file
from pi0align.dump.writing.captured_step import CAPTURED_CALL_COLUMNS, CapturedStep, CodedColumn
from pi0align.dump.writing.writer import DumpWriter
from pi0align.dump.writing.writer_process import NICENESS


@pytest.fixture(params=["at once", "queued"])
def copier(request):
    """How put() copies: at once, or queued on the native backend's kernel thread."""
    if request.param == "at once":
        return None
    native = NativeBackend.load()
    if isinstance(native, str):
        pytest.skip(f"no native backend here ({native})")
    return native.copier


@pytest.mark.timeout(120)  # a ring that never frees would hang
def test_ring_wraps_fills_and_passes_tensors_larger_than_itself(tmp_path, copier):
    generator = torch.Generator().manual_seed(0)
    tensors = [torch.randn(n, generator=generator) for n in (40_000, 70_000, 10, 300_000, 50_000, 90_000)]
    tensors.append(torch.randn(300, 200, generator=generator).to(torch.bfloat16).t())  # a view, 2-byte dtype
    # the 300k tensor does not fit; each put's tensor is a temporary, freed as put returns
    writer = DumpWriter(tmp_path / "dump.h5", tensors=True, ring_bytes=1 << 18, copier=copier)
    for step in range(2):
        writer.begin_step(step)
        paths = [writer.put(t * (step + 1)) for t in tensors]
        writer.end_step(None, [], [], None)
    writer.close()
    with h5py.File(tmp_path / "dump.h5.tensors" / "000001.h5", "r") as f:
        for path, tensor in zip(paths, tensors):
            stored = f[path.removeprefix("tensors/")]
            expected = (tensor * 2).contiguous()
            if expected.dtype == torch.bfloat16:
                expected = expected.view(torch.int16).numpy().view(np.uint16)
            else:
                expected = expected.numpy()
            assert stored.attrs["dtype"] == str(tensor.dtype).removeprefix("torch.")
            assert np.array_equal(stored[()], expected)


@pytest.mark.timeout(120)
def test_a_step_of_many_tensors_larger_than_the_ring_comes_back_exact(tmp_path, copier):
    """Past half the ring the step's tensors go to the writer process while it runs, a batch of
    commands at a time, their queued copies waited for only where the ring is full."""
    generator = torch.Generator().manual_seed(1)
    tensors = [torch.randn(int(n), generator=generator) for n in torch.randint(100, 1000, (900,), generator=generator)]
    writer = DumpWriter(tmp_path / "dump.h5", tensors=True, ring_bytes=1 << 20, copier=copier)
    writer.begin_step(0)
    paths = [writer.put(t) for t in tensors]  # about 2 MiB: the ring is filled and freed twice
    writer.end_step(None, [], [], None)
    writer.close()
    with h5py.File(tmp_path / "dump.h5.tensors" / "000000.h5", "r") as f:
        for path, tensor in zip(paths, tensors):
            assert np.array_equal(f[path.removeprefix("tensors/")][()], tensor.numpy())


def _captured(step: int, rows: int, sample_size: int, first_position: int) -> CapturedStep:
    """A step of `rows` calls with two records each in shuffled order (some dropped), and a sample
    of each record whose positions are new rows of the positions table from `first_position`."""
    generator = np.random.default_rng(step)
    calls = {c: [f"{c} {step} {i}" for i in range(rows)] for c in CAPTURED_CALL_COLUMNS}
    calls["seq"], calls["stack_id"] = list(range(rows)), generator.integers(-1, 9, rows).tolist()
    n = 2 * rows
    call_ids = np.where(generator.random(n) < 0.1, -1, np.repeat(np.arange(rows), 2))  # -1: dropped
    records = {"call_id": call_ids[generator.permutation(n)],
               "role": generator.choice(["input", "output", "grad_input"], n).tolist(),
               "arg_index": generator.integers(0, 3, n).astype(np.int32), "numel": generator.integers(1, 99, n),
               "slot": generator.integers(-1, n, n), "sample_row": np.arange(n)}
    for column in ("dtype", "tensor", "skipped"):
        records[column] = [f"{column} {step} {i}" for i in range(n)]
    # coded as the native backend hands it over: record i's shape is "[i % 3]" (its dtype says i)
    records["shape"] = CodedColumn(np.arange(n, dtype=np.int32) % 3, ["[0]", "[1]", "[2]"])
    samples = SampleRows(values=generator.random((n + 1, sample_size)), rows=np.arange(n),
                         counts=generator.integers(0, sample_size + 1, n).astype(np.int32),
                         position_rows=np.arange(first_position, first_position + n + 1),
                         new_positions=generator.integers(0, 99, (n + 1, sample_size)).astype(np.int32),
                         first_new=first_position, wide=False)
    return CapturedStep(step, calls, records, generator.random((n, 4)), generator.integers(-9, 9, (n, 3)), samples)


@pytest.mark.timeout(120)
def test_steps_handed_over_through_a_small_ring_come_back_exact(tmp_path):
    """Steps go through the ring (it wraps and fills over the steps), or through the pipe when
    they would take over half of it."""
    dump_file.create(tmp_path / "dump.h5", {}, {})
    writer = DumpWriter(tmp_path / "dump.h5", ring_bytes=1 << 16)
    steps, first_position = [], 0
    for step in range(8):
        steps.append(_captured(step, rows=20 if step % 3 else 100, sample_size=8, first_position=first_position))
        first_position += len(steps[-1].samples.new_positions)
    for captured in steps:
        writer.end_step(captured, [(captured.step, f"frames {captured.step}")], [(captured.step, 1.0, 2.0, 3.0)], None)
    writer.close()
    positions, expected = PositionTable(), []
    for captured in steps:
        tables, samples = captured.tables()
        tables.samples = positions.ordered(samples)
        expected.append(tables)
    with h5py.File(tmp_path / "dump.h5", "r") as f:
        assert list(f["stacks/frames"].asstr()) == [f"frames {s}" for s in range(8)]
        for tables in expected:
            group = f[f"steps/{tables.step:06d}"]
            assert group.attrs["complete"] and group.attrs["loss"] == 1.0
            for table, columns in (("calls", tables.calls), ("records", tables.records)):
                for name, values in columns.items():
                    stored = group[table][name]
                    stored = stored.asstr()[()] if h5py.check_string_dtype(stored.dtype) else stored[()]
                    floats = values.dtype.kind == "f"  # statistics of records with none are NaN
                    assert np.array_equal(stored, values, equal_nan=floats), (tables.step, table, name)
            rows = group["records/dtype"].asstr()[()]
            assert list(group["records/shape"].asstr()) == [f"[{int(r.split()[-1]) % 3}]" for r in rows]
            assert np.array_equal(group["samples/values"][()], tables.samples[0], equal_nan=True)
            assert np.array_equal(group["samples/positions"][()], tables.samples[1])


def test_flush_waits_until_the_step_tensors_are_on_disk(tmp_path):
    folder = tmp_path / "dump.h5.tensors"
    with Dumper(tmp_path, steps=[0], level="api", mode="tensor") as dumper:
        dumper.start()
        torch.ones(4096, 4096) * 2  # 2 x 64 MiB to write: not done by the time step() returns
        dumper.step()
        dumper.flush()
        assert (folder / "000000.h5").exists() and not list(folder.glob("*.partial"))


def test_the_writer_runs_below_the_training_process_priority(tmp_path):
    """Where training keeps every core busy, compressing and writing take what it leaves."""
    writer = DumpWriter(tmp_path / "dump.h5", tensors=True, ring_bytes=1 << 16)
    try:
        writer.begin_step(0)
        writer.put(torch.ones(100))
        writer.end_step(None, [], [], None)
        writer.flush()  # the writer has started and answered: its niceness is set
        own = os.getpriority(os.PRIO_PROCESS, 0)
        assert os.getpriority(os.PRIO_PROCESS, writer._process.pid) == min(own + NICENESS, 19)  # 19: the lowest
    finally:
        writer.close()


def test_close_frees_the_ring_and_ends_the_answers_thread_before_returning(tmp_path):
    """Otherwise the ring's last reference can fall to the answers thread while the interpreter
    exits, and freeing the torch.frombuffer tensor there aborts the process (seen: exit code 134,
    "terminate called without an active exception")."""
    writer = DumpWriter(tmp_path / "dump.h5", tensors=True, ring_bytes=1 << 16)
    writer.begin_step(0)
    writer.put(torch.ones(100))
    writer.end_step(None, [], [], None)
    writer.close()
    assert writer._ring.closed and writer._ring_tensor is None
    assert not writer._answers.is_alive()
    writer.close()  # twice is harmless


def test_chunks_compression_barely_shrinks_are_stored_unfiltered_and_read_back_exact(tmp_path):
    """Random float32 (Zstandard saves under a quarter of it) is stored as it is, both filters
    marked skipped; values with a few distinct mantissas stay compressed. h5py and compare's
    chunk reader give both back bit for bit."""
    from pi0align.compare.measuring.kernels import comparison_loops
    from pi0align.compare.reading.h5chunks import ChunkBuffers, ChunkReader, chunk_index
    from pi0align.dump.writing.tensor_store import SKIP_FILTERS, write_tensor_dataset

    rng = np.random.default_rng(0)
    tensors = {"random": rng.standard_normal((512, 1024), dtype=np.float32),
               "rounded": np.round(rng.standard_normal((512, 1024)), 1).astype(np.float32)}
    with h5py.File(tmp_path / "t.h5", "w") as f:
        for name, value in tensors.items():
            write_tensor_dataset(f, name, value, "float32")
    with h5py.File(tmp_path / "t.h5", "r") as f:
        for name, value in tensors.items():
            index = chunk_index(f[name])
            masks = {mask for _, _, mask in index.values()}
            assert masks == ({SKIP_FILTERS} if name == "random" else {0}), name
            assert np.array_equal(f[name][...], value)
            reader, buffers = ChunkReader(f[name], comparison_loops()), ChunkBuffers()
            try:
                read = [reader.read(offset, where, buffers).copy() for offset, where in sorted(index.items())]
            finally:
                reader.close()
            assert np.array_equal(np.concatenate(read), value), name
