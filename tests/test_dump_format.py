"""The dump format is defined once (`pi0align/dump/file_format.py`): the same tensors written by the
`Dumper`, on either backend, and by the tests' dump factory get equal checksums, sample positions
and samples, and both files read back alike."""

from __future__ import annotations

import h5py
import numpy as np
import torch

from pi0align import Dumper
from pi0align.compare.reading.read_ours import read_pi0align
from pi0align.dump.file_format import STR
from pi0align.testing.dump_helpers import read_step
from pi0align.testing.dumpfactory import Call, Step, write_dump

SAMPLE_SIZE = 16


def test_the_format_s_text_type_is_h5py_s_utf8_string():
    """file_format spells it without importing h5py; h5py must read it as its own."""
    assert h5py.check_string_dtype(STR) == h5py.check_string_dtype(h5py.string_dtype("utf-8"))


def test_the_dumper_and_the_test_factory_write_the_same_checksums_and_samples(tmp_path, backend):
    generator = torch.Generator().manual_seed(0)
    tensors = [torch.randn(50, 7, generator=generator), torch.randint(-9, 9, (5,), generator=generator),
               torch.randn(3, 2, generator=generator).double()]
    with Dumper(tmp_path / "dumper", steps=[0], level="api", mode="sample", sample_size=SAMPLE_SIZE,
                backend=backend) as dumper:
        dumper.start()
        outputs = [torch.neg(x) for x in tensors]
        dumper.step()
    calls = [Call(f"/Torch.neg#{k}", "", "Torch.neg", "forward", [("input", 0, x.numpy()), ("output", 0, y.numpy())])
             for k, (x, y) in enumerate(zip(tensors, outputs))]
    factory = write_dump(tmp_path / "factory.h5", [Step(0, calls, 0.0, 0.0, 0.0)], mode="sample",
                         sample_size=SAMPLE_SIZE)
    dumped, written = read_step(dumper.file, 0), read_step(factory, 0)
    assert dumped["calls"]["name"] == written["calls"]["name"] == [c.name for c in calls]
    for column in ("role", "arg_index", "dtype", "shape", "numel", "nan_count", "checksum", "sample_count", "min"):
        assert dumped["records"][column] == written["records"][column], column
    assert len(set(written["records"]["checksum"])) == 6  # real checksums, one per tensor
    assert np.array_equal(dumped["samples"]["positions"], written["samples"]["positions"])
    assert np.array_equal(dumped["samples"]["values"], written["samples"]["values"], equal_nan=True)  # NaN-padded
    assert np.allclose(dumped["records"]["norm"], written["records"]["norm"], rtol=1e-12)
    ours, theirs = read_pi0align(dumper.file), read_pi0align(factory)
    for column in ("checksum", "sample_count", "numel"):
        assert ours.records[column].tolist() == theirs.records[column].tolist(), column
