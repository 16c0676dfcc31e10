"""Readers: our HDF5 dumps and msprobe dump folders; bad input ends as one UserError line."""

from __future__ import annotations

import importlib.util
import json
import math

import h5py
import pytest

from pi0align.compare import compare_dumps
from pi0align.compare.reading.open_dump import open_run
from pi0align.errors import UserError
from pi0align.testing.dumpfactory import run_toy_model, write_dump, write_msprobe_dump


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return write_dump(tmp_path_factory.mktemp("good") / "dump.h5", run_toy_model(steps=2), mode="sample")


def test_our_dump_reads_every_record(good):
    (dump,) = open_run(good).values()
    steps = run_toy_model(steps=2)
    assert len(dump.records) == sum(len(c.records) for s in steps for c in s.calls)
    assert dump.mode == "sample" and list(dump.metrics["step"]) == [0, 1]
    stacks, apis = dump.records["stack"], dump.records["api"]
    assert all(stack.startswith("toy_model.py:") for stack in stacks) or (apis == "Parameter").any()
    values, positions = dump.sample_reader(0)
    assert values.shape == positions.shape and values.shape[0] == int((dump.records["step"] == 0).sum())
    dump.close()


@pytest.mark.parametrize("case, message", [
    ("missing", "no such file"),
    ("text", "not a dump"),
    ("format", "not a pi0align dump"),
    ("version", "version 2 is newer"),
    ("empty_folder", "no dump inside"),
    ("corrupt", "corrupt pi0align dump"),
])
def test_bad_input_is_one_user_error_line(tmp_path, good, case, message):
    path = tmp_path / "x.h5"
    if case == "text":
        path.write_text("hello")
    elif case == "format":
        with h5py.File(path, "w") as f:
            f.attrs["format"] = "something-else"
    elif case == "version":
        write_dump(path, run_toy_model(), version=2)
    elif case == "empty_folder":
        path.mkdir()
    elif case == "corrupt":
        write_dump(path, run_toy_model())
        with h5py.File(path, "r+") as f:
            del f["steps/000000/calls/name"]
    with pytest.raises(UserError, match=message) as error:
        compare_dumps(path, good)
    assert "\n" not in str(error.value)


def _msprobe_folder(tmp_path, task="statistics", data=None):
    folder = tmp_path / "ms" / "step0" / "rank0"
    folder.mkdir(parents=True)
    payload = {"task": task, "level": "mix", "framework": "pytorch", "dump_data_dir": None,
               "data": data if data is not None else {}}
    (folder / "dump.json").write_text(json.dumps(payload))
    return tmp_path / "ms"


def test_msprobe_unknown_task_and_broken_json_are_refused(tmp_path, good):
    with pytest.raises(UserError, match="task 'overflow_check' is not supported"):
        compare_dumps(_msprobe_folder(tmp_path / "a", task="overflow_check"), good)
    folder = _msprobe_folder(tmp_path / "b")
    (folder / "step0" / "rank0" / "dump.json").write_text("{not json")
    with pytest.raises(UserError, match="cannot read msprobe JSON"):
        compare_dumps(folder, good)


def test_msprobe_arguments_nested_deeper_than_python_recurses_are_refused_in_one_line(tmp_path, good):
    """orjson parses 1,024 levels, Python recurses about 1,000 deep: a dump.json whose argument is
    nested in between is refused in one line (it ended in a RecursionError's traceback)."""
    folder = _msprobe_folder(tmp_path)
    tensor = json.dumps({"type": "torch.Tensor", "dtype": "torch.float32", "shape": [1], "Max": 1.0, "Min": 0.0,
                         "Mean": 0.5, "Norm": 1.0})
    nested = "[" * 1000 + tensor + "]" * 1000
    (folder / "step0" / "rank0" / "dump.json").write_text(
        '{"task": "statistics", "data": {"Functional.linear.0.forward": {"input_args": ' + nested + "}}}")
    with pytest.raises(UserError, match="not as msprobe writes it") as error:
        compare_dumps(folder, good)
    assert "\n" not in str(error.value)


def test_msprobe_names_and_roles_are_mapped(tmp_path):
    tensor = lambda v: {"type": "torch.Tensor", "dtype": "torch.float32", "shape": [2], "Max": v, "Min": -v,
                        "Mean": 0.0, "Norm": v, "requires_grad": True}
    data = {
        "Functional.linear.0.forward": {"input_args": [tensor(1.0), tensor(2.0)], "input_kwargs": {"bias": tensor(3.0)},
                                        "output": [tensor(4.0)]},
        "Module.layer.Linear.forward.0": {"input_args": [tensor(1.0)], "input_kwargs": {}, "output": [tensor(4.0)],
                                          "parameters": {"weight": tensor(2.0)}},
        "Functional.linear.0.backward": {"input": [tensor(5.0)], "output": [tensor(6.0), None]},
        "Module.layer.Linear.parameters_grad.0": {"weight": [tensor(7.0)]},
    }
    folder = _msprobe_folder(tmp_path, data=data)
    (folder / "step0" / "rank0" / "construct.json").write_text(json.dumps(
        {"Functional.linear.0.forward": "Module.layer.Linear.forward.0", "Module.layer.Linear.forward.0": None}))
    (dump,) = open_run(folder).values()
    r = dump.records.to_pandas()
    linear = r[r["name"] == "layer/Functional.linear#0"]
    assert list(zip(linear["direction"], linear["role"], linear["arg_index"])) == [
        ("forward", "input", 0), ("forward", "input", 1), ("forward", "input", 2), ("forward", "output", 0),
        ("backward", "grad_output", 0), ("backward", "grad_input", 0)]
    weight = r[r["name"] == "layer.weight/Parameter#0"]
    assert sorted(weight["role"]) == ["parameter", "parameter_grad"] and weight["call"].nunique() == 1
    assert (r.loc[r["api"] == "Module.Linear", "module"] == "layer").all()


def test_msprobe_calls_after_the_backward_are_the_update_and_requires_grad_is_read(tmp_path):
    """msprobe records a step's clipping and the optimizer's arithmetic as forward API calls after
    its backward: they are the step's `update` phase, not its forward, and those whose stack runs
    through an optimizer's step are the optimizer's (`in_optimizer`); whether a tensor requires a
    gradient (the batch does not) is kept."""
    tensor = lambda grad: {"type": "torch.Tensor", "dtype": "torch.float32", "shape": [2], "Max": 1.0, "Min": 0.0,
                           "Mean": 0.5, "Norm": 1.0, "requires_grad": grad}
    data = {
        "Functional.linear.0.forward": {"input_args": [tensor(False), tensor(True)], "input_kwargs": {},
                                        "output": [tensor(True)]},
        "Functional.linear.0.backward": {"input": [tensor(False)], "output": [tensor(False), tensor(False)]},
        "Tensor.mul_.0.forward": {"input_args": [tensor(False)], "input_kwargs": {}, "output": [tensor(False)]},
        "Tensor.add_.0.forward": {"input_args": [tensor(True), tensor(False)], "input_kwargs": {},
                                  "output": [tensor(True)]},
    }
    folder = _msprobe_folder(tmp_path, data=data)
    frame = "File {}, line 9, in {}, \n code"
    clip = [frame.format("/venv/torch/nn/utils/clip_grad.py", "clip_grad_norm_"), frame.format("train.py", "main")]
    adam = [frame.format("/venv/torch/optim/adam.py", "_single_tensor_adam"),
            frame.format("/venv/torch/optim/optimizer.py", "wrapper"), frame.format("train.py", "main")]
    (folder / "step0" / "rank0" / "stack.json").write_text(json.dumps(
        {"0": [["Tensor.mul_.0.forward"], clip], "1": [["Tensor.add_.0.forward"], adam]}))
    (dump,) = open_run(folder).values()
    r = dump.records.to_pandas()
    assert r.groupby("name")["direction"].unique().map(list).to_dict() == {
        "/Functional.linear#0": ["forward", "backward"], "/Tensor.mul_#0": ["update"],
        "/Tensor.add_#0": ["in_optimizer"]}
    linear = r[(r["name"] == "/Functional.linear#0") & (r["direction"] == "forward")]
    assert list(linear["requires_grad"]) == [0, 1, 1]


msprobe = pytest.mark.skipif(importlib.util.find_spec("msprobe") is None, reason="mindstudio-probe not installed")


@msprobe
@pytest.mark.slow  # two msprobe runs, each importing torch and msprobe in a child process
def test_real_msprobe_dumps_compare_and_find_the_fault(tmp_path):
    a = write_msprobe_dump(tmp_path / "a", task="statistics")
    b = write_msprobe_dump(tmp_path / "b", task="statistics", scale=1 + 1e-3)
    same = compare_dumps(a, a)
    assert same.verdict == "aligned" and same.coverage["only_a"] == 0 and same.coverage["matched"] > 20
    result = compare_dumps(a, b)
    assert result.verdict == "diverged"
    assert result.first_divergence.api == "Tensor.__mul__"
    assert result.culprits[0].api in ("Tensor.__mul__", "Module.Scale")


@msprobe
def test_msprobe_tensor_dump_against_our_dump_of_the_same_values(tmp_path):
    """Either side may be msprobe's: a pi0align dump built from the msprobe dump's own tensors,
    once faithfully and once with one call's output scaled, compares against the msprobe folder."""
    import numpy as np

    from pi0align.testing.dumpfactory import Call, Step

    ms = write_msprobe_dump(tmp_path / "ms", task="tensor")
    (dump,) = open_run(ms).values()
    steps = []
    for faulty in (False, True):
        calls = []
        for (_, name), group in dump.records.to_pandas().groupby(["call", "name"], sort=True):
            records = []
            for row in group.itertuples():
                value = np.asarray(dump.tensor(row.Index), np.float32)
                if faulty and row.api == "Tensor.__mul__" and row.role == "output" and row.direction == "forward":
                    value = value * np.float32(1 + 1e-3)
                records.append((row.role, row.arg_index, value))
            calls.append(Call(name, group["module"].iloc[0], group["api"].iloc[0], group["direction"].iloc[0], records))
        steps.append([Step(0, calls, 0.0, 0.0, 0.01)])
    dump.close()
    ours = write_dump(tmp_path / "ours.h5", steps[0], mode="tensor")
    faulty = write_dump(tmp_path / "faulty.h5", steps[1], mode="tensor")
    assert compare_dumps(ms, ours).verdict == "aligned"
    result = compare_dumps(ms, faulty)
    assert result.verdict == "diverged" and result.first_divergence.api == "Tensor.__mul__"


def test_a_step_whose_tensor_file_is_missing_is_compared_on_statistics(tmp_path):
    import shutil

    import torch

    from pi0align import Dumper

    x = torch.arange(4096, dtype=torch.float32).reshape(64, 64)
    with Dumper(tmp_path / "a", steps=[0, 1], level="api", mode="tensor") as dumper:
        dumper.start()
        for _ in range(2):
            (x * 2).relu()
            dumper.step()
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    (tmp_path / "b" / "dump.h5.tensors" / "000001.h5").unlink()  # as after a crash before the writer finished
    result = compare_dumps(tmp_path / "a", tmp_path / "b")
    assert result.verdict == "aligned"
    assert any("step 1's full tensors are missing" in note for note in result.notes)
    evidence = result.table()["evidence"][result.table()["step"] == 1]
    assert len(evidence) and set(evidence) == {"stats"}
    assert set(result.table()["evidence"][result.table()["step"] == 0]) == {"tensor"}


@msprobe
@pytest.mark.slow  # real PI0 small under msprobe's PrecisionDebugger, in a child process
def test_msprobe_dumps_of_real_pi0_with_infinite_statistics_are_read(tmp_path):
    """msprobe writes Infinity / -Infinity / NaN into dump.json (PI0's attention masks hold -2.4e38,
    so their means are -inf): the reader takes them, and the dump compares against itself."""
    import subprocess
    import sys

    script = ("import sys; from pi0align.testing.scenarios import dump_pi0_with_msprobe; "
              "dump_pi0_with_msprobe(sys.argv[1])")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    dump_json = next((tmp_path / "msprobe").glob("step*/*/dump.json"))
    text = dump_json.read_text()
    assert "Infinity" in text or "NaN" in text  # what orjson refuses
    result = compare_dumps(tmp_path / "msprobe", tmp_path / "msprobe")
    assert result.verdict == "aligned" and result.coverage["matched"] > 1000 and not result.culprits
    assert (result.rows["pairing"] == "matched").all()


def test_torch_files_are_read_without_torch_as_torch_reads_them(tmp_path):
    """msprobe's `.pt` tensors, read by our restricted reader: the values torch.load gives, in every
    dtype msprobe dumps, contiguous or not, views into a larger storage, empty and 0-d."""
    import numpy as np
    import torch

    from pi0align.compare.reading.torch_files import load_tensor

    base = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))
    tensors = {"float32": base, "float64": base.double(), "float16": base.half(), "bfloat16": base.bfloat16(),
               "int64": torch.arange(12).reshape(3, 4), "bool": base > 0, "uint8": torch.arange(5, dtype=torch.uint8),
               "transposed": base.t(), "slice": base[2:5, 1::2], "rows": base[2:5], "empty": torch.zeros(0, 3),
               "scalar": base[1, 1]}
    for name, tensor in tensors.items():
        path = tmp_path / f"{name}.pt"
        torch.save(tensor, path)
        expected = torch.load(path, weights_only=True)
        expected = expected.float() if expected.dtype in (torch.float16, torch.bfloat16) else expected
        read = load_tensor(path)
        assert read.shape == tuple(expected.shape) and read.dtype == expected.numpy().dtype, name
        assert np.array_equal(read, expected.numpy()), name



def test_a_torch_file_whose_tensor_reaches_past_its_storage_is_refused(tmp_path):
    """A pickle that describes a tensor larger than its storage, with negative strides, or with
    fewer strides than dimensions, is no tensor: refused in one line, nothing read outside the
    file's bytes."""
    import zipfile

    import torch

    from pi0align.compare.reading.read_msprobe import _load_tensor
    from pi0align.compare.reading.records import TensorRecord

    genuine = tmp_path / "genuine.pt"
    torch.save(torch.arange(6.0), genuine)
    cases = (("whole", (6,), (1,)), ("huge", (1 << 40,), (1,)), ("negative", (6,), (-1,)), ("ranks", (2, 3), (1,)))
    for name, shape, strides in cases:
        forged = tmp_path / f"{name}.pt"
        with zipfile.ZipFile(genuine) as source, zipfile.ZipFile(forged, "w") as target:
            for item in source.infolist():
                forging = item.filename.endswith("data.pkl")
                target.writestr(item, tensor_pickle(shape, strides) if forging else source.read(item))
        record = TensorRecord(0, str(forged), str(list(shape)), "float32", math.prod(shape))  # as dump.json says
        if name == "whole":  # the forging itself is sound: the genuine description reads
            assert _load_tensor(record).tolist() == list(range(6))
            continue
        with pytest.raises(UserError, match="not a tensor file as msprobe writes it"):
            _load_tensor(record)


def tensor_pickle(shape: tuple, strides: tuple, key: str = "0", elements: int = 6) -> bytes:
    """The pickle torch.save writes for a float32 tensor on storage `key` of `elements` elements,
    with the given shape and strides, in pickle's opcodes (protocol 2)."""
    def items(*parts: bytes) -> bytes:
        return b"(" + b"".join(parts) + b"t"

    def number(n: int) -> bytes:
        return b"I" + str(n).encode() + b"\n"

    def text(value: str) -> bytes:
        return b"X" + len(value).to_bytes(4, "little") + value.encode()

    storage = items(text("storage"), b"ctorch\nFloatStorage\n", text(key), text("cpu"), number(elements)) + b"Q"
    arguments = items(storage, number(0), items(*map(number, shape)), items(*map(number, strides)), b"\x89", b"}")
    return b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n" + arguments + b"R."
