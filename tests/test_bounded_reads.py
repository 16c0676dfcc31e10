"""A size a file states never sizes an allocation unchecked (compare/reading/sizes.py): a dataset,
tensor file, chunk, sample table or journal that states more than its records say or its file holds
is one line naming it, exit 2, in bounded memory; fuzzed with hypothesis, each compare in a process
whose address space may grow by LIMIT at most."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import resource
import shutil
import struct
import subprocess
import sys
import tempfile
import traceback
import zipfile
from pathlib import Path

import h5py
import hdf5plugin
import pytest
from conftest import pi0align
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_compare_readers import tensor_pickle

from pi0align.dump.writing.journal import journal_path
from pi0align.testing.dumpfactory import run_toy_model, write_dump

LIMIT = 640 << 20  # what a compare's address space may grow by: Python, numpy, h5py and their threads
FUZZ = settings(max_examples=40, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
HUGE = (100_000, 100_000)  # 40 GB of float32, none of it on disk


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    root = tmp_path_factory.mktemp("dumps")
    steps = run_toy_model(steps=2)
    return {mode: write_dump(root / mode / "dump.h5", steps, mode=mode) for mode in ("tensor", "sample", "stats")}


def _copy(dump: Path, folder: Path) -> Path:
    shutil.copytree(dump.parent, folder / "b")
    return folder / "b" / dump.name


def _tensor_file(dump: Path) -> Path:
    return dump.parent / f"{dump.name}.tensors" / "000000.h5"


def _unallocated(group: h5py.Group, name: str, shape: tuple, dtype="float32", compressed: bool = False) -> None:
    """`name` replaced by a dataset of `shape` whose bytes were never written: no room on disk."""
    del group[name]
    options = dict(chunks=True, **hdf5plugin.Zstd()) if compressed and math.prod(shape) else {}
    group.create_dataset(name, shape=shape, dtype=dtype, **options)


def compare_in_bounded_memory(a: Path, b: Path, *flags: str) -> tuple[int, str]:
    """`pi0align compare A B --no-html` in a forked process whose address space may grow by LIMIT
    over this one's: (exit code, stderr); 99 and the traceback where it raised."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, and leave without running the parent's cleanup
        try:
            os.close(read)
            size = next(int(line.split()[1]) << 10 for line in open("/proc/self/status") if line.startswith("VmSize"))
            resource.setrlimit(resource.RLIMIT_AS, (size + LIMIT, size + LIMIT))
            result = pi0align("compare", a, b, "--no-html", *flags)
        except BaseException:  # noqa: BLE001 - whatever it is, the parent must hear of it
            result = (99, traceback.format_exc())
        with os.fdopen(write, "w") as out:
            json.dump(result, out)
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as got:
        code, stderr = json.load(got)
    os.waitpid(pid, 0)
    return code, stderr


def assert_result_or_one_line(code: int, stderr: str, named: str | None = None) -> None:
    """A verdict, or one line naming the damaged file (never 'out of memory', never a traceback)."""
    assert code in (0, 1, 2), stderr
    if code == 2:
        lines = stderr.strip().splitlines()
        assert len(lines) == 1 and "error:" in lines[0] and "out of memory" not in lines[0], stderr
        assert named is None or named in lines[0], lines[0]


@pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs util-linux's prlimit")
@pytest.mark.parametrize("replay", [False, True])
def test_a_tensor_dataset_larger_than_its_record_is_one_line_in_bounded_memory(dumps, tmp_path, replay):
    """A (16, 16) tensor replaced by an unallocated 100,000 × 100,000 float32 dataset of the same
    name: one line naming it, before it is read (before: 40 GB allocated, or 'out of memory' under
    a limit). With replay, torch's import needs more room: 6 GiB then, still far under 40 GB."""
    b = _copy(dumps["tensor"], tmp_path)
    with h5py.File(_tensor_file(b), "r+") as f:
        name = next(n for n in f if f[n].shape == (16, 16))
        _unallocated(f, name, HUGE)
    limit = (6 << 30) if replay else LIMIT
    done = subprocess.run(["prlimit", f"--as={limit}", sys.executable, "-m", "pi0align.cli.main", "compare",
                           str(dumps["tensor"]), str(b), "--no-html", *([] if replay else ["--no-replay"])],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "damaged" in lines[0] and f"tensors/{name}" in lines[0], done.stderr
    assert "[100000, 100000]" in lines[0] and "[16, 16]" in lines[0]


DIMS = st.lists(st.integers(0, 1 << 24) | st.sampled_from([0, 1, 16, 4, 1 << 31]), min_size=0, max_size=3)


def _damage_ours(draw, dumps: dict, folder: Path) -> tuple[Path, Path, str]:
    """(A, a damaged copy B, the file the error must name): one size in B drawn anew."""
    what = draw(st.sampled_from(["tensor shape", "tensor dtype", "record shape", "record numel", "column length",
                                 "sample table", "metrics length"]))
    mode = {"sample table": "sample", "metrics length": "stats", "column length": "stats"}.get(what, "tensor")
    b = _copy(dumps[mode], folder)
    if what in ("tensor shape", "tensor dtype"):
        with h5py.File(_tensor_file(b), "r+") as f:
            name = draw(st.sampled_from(sorted(f)))
            shape = tuple(draw(DIMS)) if what == "tensor shape" else f[name].shape
            if math.prod(shape) * 8 < 1 << 62:
                _unallocated(f, name, shape, draw(st.sampled_from(["float32", "float64", "int8"])),
                             compressed=draw(st.booleans()))
        return dumps[mode], b, "000000.h5"
    with h5py.File(b, "r+") as f:
        step = f["steps/000000"]
        if what == "record shape":
            shapes = step["records/shape"].asstr()[()]
            shapes[draw(st.integers(0, len(shapes) - 1))] = json.dumps(draw(DIMS))
            del step["records/shape"]
            step["records"].create_dataset("shape", data=shapes.astype(object), dtype=h5py.string_dtype())
        elif what == "record numel":
            numel = step["records/numel"]
            numel[draw(st.integers(0, len(numel) - 1))] = draw(st.integers(-1, 1 << 62))
        elif what == "column length":
            column = draw(st.sampled_from(["min", "role", "call_id", "checksum"]))
            group = step["records"]
            _unallocated(group, column, (draw(st.integers(0, 1 << 40)),), group[column].dtype)
        elif what == "sample table":
            _unallocated(step["samples"], draw(st.sampled_from(["values", "positions"])),
                         tuple(draw(st.lists(st.integers(0, 1 << 24), min_size=2, max_size=2))))
        else:
            _unallocated(f["metrics"], "loss", (draw(st.integers(0, 1 << 40)),), "float64")
    return dumps[mode], b, b.name


@FUZZ
@given(st.data())
def test_sizes_in_our_dumps_fuzzed_give_a_verdict_or_one_line_in_bounded_memory(dumps, data):
    with tempfile.TemporaryDirectory() as folder:
        a, b, named = _damage_ours(data.draw, dumps, Path(folder))
        assert_result_or_one_line(*compare_in_bounded_memory(a, b, "--no-replay"), named)


@FUZZ
@given(length=st.integers(0, 1 << 62), offset=st.integers(0, 1 << 62), count=st.integers(0, 1 << 20),
       kept=st.integers(0, 64))
def test_a_journal_fuzzed_rolls_back_or_is_one_line_and_leaves_the_file(dumps, length, offset, count, kept):
    """A journal beside a dump (an append its writer did not finish): its stated file length and
    saved ranges drawn; the reader rolls back what an append could have saved (the dump as it was
    before: what is left of it compared, or one line), or refuses the journal in one line, the
    dump untouched."""
    with tempfile.TemporaryDirectory() as folder:
        b = _copy(dumps["stats"], Path(folder))
        before = b.read_bytes()
        saved = b"\0" * min(count, kept)  # a journal cut short: its last range not all there
        journal_path(b).write_bytes(struct.pack("<Q", length) + struct.pack("<QQ", offset, count) + saved)
        code, stderr = compare_in_bounded_memory(dumps["stats"], b)
        assert_result_or_one_line(code, stderr, b.name)
        if ".journal" in stderr:
            assert b.read_bytes() == before
        else:  # rolled back: never longer than the file, or than the bytes the journal gave back
            assert b.stat().st_size <= max(len(before), offset + len(saved) if len(saved) == count else 0)


# -- msprobe's dumps: the shapes in dump.json, the storages of its .pt files ----------------------------

msprobe = pytest.mark.skipif(importlib.util.find_spec("msprobe") is None, reason="mindstudio-probe not installed")


@pytest.fixture(scope="module")
def msprobe_tensors(tmp_path_factory):
    from pi0align.testing.dumpfactory import write_msprobe_dump

    return write_msprobe_dump(tmp_path_factory.mktemp("ms") / "ms", task="tensor")


def _storage_entry(path: Path, compress: bool, stated: int | None) -> None:
    """The .pt file's storage entry deflated (torch.save stores it), or its stated size changed."""
    with zipfile.ZipFile(path) as source:
        entries = [(info, source.read(info)) for info in source.infolist()]
    with zipfile.ZipFile(path, "w") as target:
        for info, data in entries:
            if "/data/" in info.filename:
                info.compress_type = zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED
            target.writestr(info, data)
    if stated is not None:  # the local header's and the central directory's uncompressed size
        raw = bytearray(path.read_bytes())
        for signature, at in ((b"PK\x03\x04", 22), (b"PK\x01\x02", 24)):
            start = raw.find(signature, raw.find(b"/data/") - 64 if signature == b"PK\x03\x04" else 0)
            while start >= 0:
                name_length = struct.unpack_from("<H", raw, start + (26 if signature == b"PK\x03\x04" else 28))[0]
                name_at = start + (30 if signature == b"PK\x03\x04" else 46)
                if b"/data/" in raw[name_at:name_at + name_length]:
                    struct.pack_into("<I", raw, start + at, stated & 0xFFFFFFFF)
                start = raw.find(signature, start + 4)
        path.write_bytes(bytes(raw))


@msprobe
@FUZZ
@given(st.data())
def test_sizes_in_msprobe_dumps_fuzzed_give_a_verdict_or_one_line_in_bounded_memory(msprobe_tensors, data):
    with tempfile.TemporaryDirectory() as folder:
        b = Path(folder) / "ms"
        shutil.copytree(msprobe_tensors, b)
        dump_json = next(b.glob("step*/*/dump.json"))
        tensors = sorted(b.glob("step*/*/dump_tensor_data/*.pt"))
        what = data.draw(st.sampled_from(["json shape", "pt shape", "pt storage"]))
        if what == "json shape":
            payload = json.loads(dump_json.read_text())
            entries = [t for call in payload["data"].values() for t in _tensor_entries(call)]
            data.draw(st.sampled_from(entries))["shape"] = data.draw(
                st.lists(st.integers(-2, 1 << 40) | st.floats(0, 1e30), max_size=3))
            dump_json.write_text(json.dumps(payload))
        elif what == "pt shape":
            target = data.draw(st.sampled_from(tensors))
            _repickle_shape(target, tuple(data.draw(st.lists(st.integers(0, 1 << 40), max_size=3))))
        else:
            _storage_entry(data.draw(st.sampled_from(tensors)), compress=data.draw(st.booleans()),
                           stated=data.draw(st.none() | st.integers(0, (1 << 32) - 1)))
        assert_result_or_one_line(*compare_in_bounded_memory(msprobe_tensors, b, "--no-replay"))


def _tensor_entries(value) -> list[dict]:
    if isinstance(value, dict):
        if "shape" in value and "dtype" in value:
            return [value]
        value = list(value.values())
    return [t for item in value for t in _tensor_entries(item)] if isinstance(value, list) else []


def _repickle_shape(path: Path, shape: tuple) -> None:
    """The .pt file's float32 tensor described with another shape (contiguous strides), its storage
    as it is."""
    with zipfile.ZipFile(path) as source:
        entries = [(info, source.read(info)) for info in source.infolist()]
    storage = next(info for info, _ in entries if "/data/" in info.filename)
    strides, step = [], 1
    for n in reversed(shape):
        strides.insert(0, step)
        step *= max(n, 1)
    forged = tensor_pickle(shape, tuple(strides), key=storage.filename.rpartition("/")[2],
                           elements=storage.file_size // 4)
    with zipfile.ZipFile(path, "w") as target:
        for info, data in entries:
            target.writestr(info, forged if info.filename.endswith("data.pkl") else data)
