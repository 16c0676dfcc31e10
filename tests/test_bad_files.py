"""Bad files (docs/reliability.md): every command that reads a dump, a run folder, an msprobe folder
or a checkpoint ends with one line naming the file and the problem, exit 2, no traceback; and the
readers, fuzzed with hypothesis on mutated real files, end with a result or that one line, never
otherwise; dumps with nothing to compare are one line saying what did not match, never "aligned"."""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import assert_one_line_error, pi0align, run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pi0align.compare import compare_dumps
from pi0align.testing.dumpfactory import run_toy_model, write_dump, write_msprobe_dump

TINY = ("--preset", "tiny", "--batch-size", "4", "--threads", "1", "--no-progress", "--log-every", "0")
FUZZ = settings(max_examples=40, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def assert_one_line_naming(code: int, stderr: str, path: Path, given: Path | None = None) -> None:
    """Exit 2 and one line naming the bad file (or the folder it was `given` in)."""
    assert code == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "error:" in lines[0] and "Traceback" not in stderr, stderr
    assert path.name in lines[0] or (given is not None and str(given) in lines[0]), lines[0]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A real tiny PI0 run (2 steps, a checkpoint after each), recorded as a baseline, and a toy dump."""
    root = tmp_path_factory.mktemp("files")
    done = run_cli("run", *TINY, "--steps", "2", "--save-every", "1", "--out", root / "run")
    assert done.returncode == 0, done.stderr
    toy = write_dump(root / "toy" / "dump.h5", run_toy_model(steps=2), mode="tensor")
    code, stderr = pi0align("check", root / "run", "--save-baseline", "run", "--baselines", root / "baselines")
    assert code == 0, stderr
    return {"run": root / "run", "toy": toy, "baseline": ("--baseline", "run", "--baselines", root / "baselines")}


def _zero_bytes(path: Path) -> None:
    path.write_bytes(b"")


def _text(path: Path) -> None:
    path.write_text("step,loss\n0,1.0\n")


def _truncated(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _foreign_hdf5(path: Path) -> None:
    with h5py.File(path, "w") as f:
        f.create_dataset("images", data=np.zeros((4, 4)))


def _newer_version(path: Path) -> None:
    with h5py.File(path, "r+") as f:
        f.attrs["version"] = 99


DUMP_DAMAGE = {"zero-byte": _zero_bytes, "text named .h5": _text, "truncated": _truncated,
               "written by another program": _foreign_hdf5, "unknown format version": _newer_version}


@pytest.mark.parametrize("damage", DUMP_DAMAGE)
@pytest.mark.parametrize("command", ["compare", "replay", "env-diff"])
def test_a_damaged_dump_is_one_line_naming_it(files, tmp_path, command, damage):
    bad = tmp_path / "bad.h5"
    shutil.copy(files["toy"], bad)
    DUMP_DAMAGE[damage](bad)
    arguments = {"compare": (bad, files["toy"], "--no-html"),
                 "replay": (bad, "m/Functional.linear#0"),
                 "env-diff": (bad, files["toy"])}[command]
    assert_one_line_naming(*pi0align(command, *arguments), bad)


def _run_copy(files, tmp_path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(files["run"], run)
    return run


@pytest.mark.parametrize("command", ["env-diff", "curves", "check"])
@pytest.mark.parametrize("name, content", [
    ("manifest.json", "{not json"), ("manifest.json", "[1, 2]"),
    ("train_log.jsonl", '{"step": 0, "loss": 1.0}\n\x00\x01\n{"step": 1, "loss": 1.0}\n'), ("summary.json", "")])
def test_a_damaged_run_folder_is_one_line_naming_the_file(files, tmp_path, command, name, content):
    run = _run_copy(files, tmp_path)
    (run / name).write_text(content)
    read_by = ("manifest.json", "summary.json") if command == "env-diff" else (name,)  # the others need all
    arguments = {"env-diff": (run, files["run"]), "curves": (run, files["run"]),
                 "check": (run, *files["baseline"])}[command]
    code, stderr = pi0align(command, *arguments)
    if name in read_by:
        assert_one_line_naming(code, stderr, run / name)
    else:
        assert code in (0, 1), stderr


def _msprobe(tmp_path_factory) -> Path:
    return write_msprobe_dump(tmp_path_factory.mktemp("msprobe") / "dump", steps=1)


@pytest.fixture(scope="module")
def msprobe(tmp_path_factory):
    pytest.importorskip("msprobe")
    return _msprobe(tmp_path_factory)


def _dump_json(folder: Path) -> Path:
    return next(folder.glob("step*/*/dump.json"))


@pytest.mark.parametrize("mutation", ["no data", "data a list", "a tensor without its shape", "a tensor without Max",
                                      "a statistic that is text", "a shape that is a number"])
def test_an_msprobe_dump_json_with_missing_fields_or_wrong_types_is_one_line(msprobe, tmp_path, mutation):
    folder = tmp_path / "ms"
    shutil.copytree(msprobe, folder)
    path = _dump_json(folder)
    payload = json.loads(path.read_text())
    entry = next(iter(payload["data"].values()))
    record = next(r for r in entry.get("input_args", []) + entry.get("output", []) if isinstance(r, dict))
    if mutation == "no data":
        del payload["data"]
    elif mutation == "data a list":
        payload["data"] = [1, 2]
    elif mutation == "a tensor without its shape":
        del record["shape"]
    elif mutation == "a tensor without Max":
        del record["Max"]
    elif mutation == "a statistic that is text":
        record["Max"] = "large"
    else:
        record["shape"] = 7
    path.write_text(json.dumps(payload))
    assert_one_line_naming(*pi0align("compare", folder, msprobe, "--no-html"), path)


def test_msprobe_statistics_that_are_bools_or_none_are_read(msprobe, tmp_path):
    """What msprobe writes for a bool tensor (True/False) and for a statistic it has none of (None)."""
    folder = tmp_path / "ms"
    shutil.copytree(msprobe, folder)
    path = _dump_json(folder)
    payload = json.loads(path.read_text())
    records = [r for entry in payload["data"].values() for r in entry.get("output", []) if isinstance(r, dict)]
    records[0].update(Min=False, Max=True)
    records[1].update(Mean=None)
    path.write_text(json.dumps(payload))
    code, stderr = pi0align("compare", folder, msprobe, "--no-html")
    assert code in (0, 1), stderr


@pytest.mark.slow  # two processes that import torch and LeRobot
def test_run_resume_from_a_damaged_or_foreign_checkpoint_is_one_line(files, tmp_path):
    run = _run_copy(files, tmp_path)
    checkpoint = run / "checkpoints" / "000001"
    weights = checkpoint / "pretrained_model" / "model.safetensors"
    from safetensors.numpy import load_file, save_file

    tensors = load_file(weights)
    name = next(iter(tensors))
    tensors[name] = np.zeros((3, 5), tensors[name].dtype)  # another model's tensor of that name
    save_file(tensors, weights)
    assert_one_line_error(run_cli("run", "--resume", checkpoint), "model.safetensors")
    state = checkpoint / "training_state.pt"
    state.write_bytes(state.read_bytes()[:100])  # truncated
    shutil.copy(files["run"] / "checkpoints" / "000001" / "pretrained_model" / "model.safetensors", weights)
    assert_one_line_error(run_cli("run", "--resume", checkpoint), state.name)


# -- fuzzing: mutated real files, a bounded and seeded number of examples -----------------------------


def _mutate(data: bytes, flips: list[tuple[float, int]], cut: float | None) -> bytes:
    mutated = bytearray(data)
    for where, bits in flips:
        mutated[int(where * (len(mutated) - 1))] ^= bits
    return bytes(mutated[: int(cut * len(mutated))] if cut is not None else mutated)


MUTATIONS = (st.lists(st.tuples(st.floats(0, 1), st.integers(1, 255)), min_size=1, max_size=8),
             st.one_of(st.none(), st.floats(0, 1)))


@FUZZ
@given(*MUTATIONS)
def test_a_mutated_dump_is_compared_or_refused_in_one_line(files, flips, cut):
    data = files["toy"].read_bytes()
    with tempfile.TemporaryDirectory() as folder:
        bad = Path(folder) / "dump.h5"
        bad.write_bytes(_mutate(data, flips, cut))
        tensors = files["toy"].parent / "dump.h5.tensors"
        shutil.copytree(tensors, Path(folder) / tensors.name)
        code, stderr = pi0align("compare", bad, files["toy"], "--no-html")
    if code == 2:
        assert_one_line_naming(code, stderr, bad)
    else:
        assert code in (0, 1) and "Traceback" not in stderr, stderr


@FUZZ
@given(st.sampled_from(["manifest.json", "train_log.jsonl", "summary.json"]), *MUTATIONS)
def test_a_mutated_run_folder_is_read_or_refused_in_one_line(files, name, flips, cut):
    with tempfile.TemporaryDirectory() as folder:
        run = Path(folder) / "run"
        run.mkdir()
        for part in ("manifest.json", "train_log.jsonl", "summary.json"):
            shutil.copy(files["run"] / part, run / part)
        (run / name).write_bytes(_mutate((run / name).read_bytes(), flips, cut))
        for command in (("env-diff", run, files["run"]), ("curves", run, files["run"]),
                        ("check", run, *files["baseline"])):
            code, stderr = pi0align(*command)
            if code == 2:
                assert_one_line_naming(code, stderr, run / name)
            else:
                assert code in (0, 1) and "Traceback" not in stderr, stderr


def _containers(inner):
    return st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)


JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                           _containers, max_leaves=6)


@FUZZ
@given(st.data())
def test_an_msprobe_dump_json_mutated_is_compared_or_refused_in_one_line(msprobe, data):
    payload = json.loads(_dump_json(msprobe).read_text())
    for _ in range(data.draw(st.integers(1, 4))):  # replace or delete a value somewhere in the tree
        node = payload
        while isinstance(node, (dict, list)) and node and data.draw(st.booleans()):
            keys = list(node) if isinstance(node, dict) else list(range(len(node)))
            key = data.draw(st.sampled_from(keys))
            if not isinstance(node[key], (dict, list)) or not node[key]:
                break
            node = node[key]
        if isinstance(node, (dict, list)) and node:
            keys = list(node) if isinstance(node, dict) else list(range(len(node)))
            key = data.draw(st.sampled_from(keys))
            if data.draw(st.booleans()):
                del node[key]
            else:
                node[key] = data.draw(JSON_VALUES)
    with tempfile.TemporaryDirectory() as folder:
        copy = Path(folder) / "ms"
        shutil.copytree(msprobe, copy)
        path = _dump_json(copy)
        path.write_text(json.dumps(payload))
        code, stderr = pi0align("compare", copy, msprobe, "--no-html")
    if code == 2:
        assert_one_line_naming(code, stderr, path, given=copy)
    else:
        assert code in (0, 1) and "Traceback" not in stderr, stderr


# -- mismatched or empty inputs: never "aligned", one line saying what did not match ----------------


def _renamed(steps):
    return [dataclasses.replace(s, calls=[dataclasses.replace(c, name=f"policy.{c.name}", module=f"policy.{c.module}")
                                          for c in s.calls]) for s in steps]


@pytest.mark.parametrize("case, fragments", [
    ("other steps", ("no step in common", "steps 0, 1", "steps 5, 6")),
    ("other ranks", ("different ranks", "[0]", "[1]")),
    ("empty", ("holds no complete dumped step",)),
    ("only incomplete steps", ("holds no complete dumped step", "incomplete")),
    ("no common records", ("0 of the", "pair with one of", "policy.model")),
    ("few common records", ("pair with one of", "policy.model")),
])
def test_dumps_with_nothing_to_compare_are_one_line_saying_what_did_not_match(tmp_path, case, fragments):
    base = write_dump(tmp_path / "a.h5", run_toy_model(steps=2))
    steps = run_toy_model(steps=2)
    other = tmp_path / "b.h5"
    if case == "other steps":
        write_dump(other, [dataclasses.replace(s, step=s.step + 5) for s in steps])
    elif case == "other ranks":
        write_dump(other, steps, rank=1, world_size=2)
    elif case == "empty":
        write_dump(other, [])
    elif case == "only incomplete steps":
        write_dump(other, steps, complete=False)
    elif case == "no common records":
        write_dump(other, _renamed(steps))
    else:  # its first two calls of each step named as in A
        write_dump(other, [dataclasses.replace(s, calls=s.calls[:2] + renamed.calls[2:])
                           for s, renamed in zip(steps, _renamed(steps))])
    code, stderr = pi0align("compare", base, other, "--no-html")
    assert code == 2 and len(stderr.strip().splitlines()) == 1, stderr
    for fragment in fragments:
        assert fragment in stderr, stderr


def test_dumps_of_different_models_diverge_and_say_the_shapes_differ(tmp_path):
    a = write_dump(tmp_path / "a.h5", run_toy_model(steps=1))
    b = write_dump(tmp_path / "b.h5", run_toy_model(steps=1, width=8, layers=5))
    comparison = compare_dumps(a, b)
    assert comparison.verdict == "diverged"
    assert comparison.coverage["shape_mismatch"] > 0 and comparison.coverage["only_b"] > 0
