"""Security (docs/reliability.md): nothing read from a dump, manifest, msprobe folder or checkpoint
runs code. Checkpoints and msprobe tensors load with weights_only; the sources unpickle, eval or
exec nothing read from a file; every string from a file is text in the HTML report (in Chromium)
and in the console (no rich markup)."""

from __future__ import annotations

import ast
import csv
import dataclasses
import pickle
import shutil
import zipfile

import pytest
from conftest import REPO, assert_one_line_error, pi0align, run_cli

from pi0align.compare import compare_dumps
from pi0align.errors import UserError
from pi0align.report.comparison.html import write_html
from pi0align.testing.dumpfactory import Fault, default_manifest, run_toy_model, write_dump

PACKAGE = REPO / "pi0align"
# The one place pickles are read: the dump's writer process and the training process talk through a
# pipe between them, and nothing else writes to it.
PIPE_MODULES = {"dump/writing/writer.py", "dump/writing/writer_process.py"}


class _Payload:
    """A pickle that, unpickled, writes a file: the shape of every pickle attack."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.slow  # a run and a resume, each a process that imports torch and LeRobot
def test_a_checkpoint_whose_state_would_run_code_is_refused_in_one_line(tmp_path):
    run = tmp_path / "run"
    done = run_cli("run", "--preset", "tiny", "--batch-size", "2", "--threads", "1", "--steps", "1", "--save-every",
                   "1", "--no-progress", "--log-every", "0", "--out", run)
    assert done.returncode == 0, done.stderr
    marker = tmp_path / "pwned"
    state = run / "checkpoints" / "000001" / "training_state.pt"
    state.write_bytes(pickle.dumps({"optimizer": _Payload(marker)}))
    assert_one_line_error(run_cli("run", "--resume", run), "training_state.pt")
    assert not marker.exists()


def test_an_msprobe_tensor_file_that_would_run_code_is_not_unpickled(tmp_path):
    pytest.importorskip("msprobe")
    from pi0align.testing.dumpfactory import write_msprobe_dump

    clean = write_msprobe_dump(tmp_path / "ms", task="tensor")
    folder = tmp_path / "poisoned"
    shutil.copytree(clean, folder)
    marker = tmp_path / "pwned"
    for tensor in folder.glob("**/dump_tensor_data/*.pt"):
        tensor.write_bytes(pickle.dumps(_Payload(marker)))
    code, stderr = pi0align("compare", folder, clean, "--no-html")
    assert not marker.exists()
    assert code in (1, 2) and "Traceback" not in stderr, stderr


def test_a_torch_file_whose_pickle_names_anything_but_a_tensor_is_refused_unread(tmp_path):
    """A `.pt` file as torch.save writes it (a zip holding data.pkl), whose pickle calls a function
    of the payload's: refused in one line, the function never called; the genuine file reads."""
    import torch

    from pi0align.compare.reading.read_msprobe import _load_tensor
    from pi0align.compare.reading.records import TensorRecord

    genuine = tmp_path / "genuine.pt"
    torch.save(torch.arange(6.0).reshape(2, 3), genuine)
    record = lambda path: TensorRecord(0, str(path), "[2, 3]", "float32", 6)  # noqa: E731 - as dump.json says
    assert _load_tensor(record(genuine)).tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    marker = tmp_path / "pwned"
    poisoned = tmp_path / "poisoned.pt"
    with zipfile.ZipFile(genuine) as source, zipfile.ZipFile(poisoned, "w") as target:
        for item in source.infolist():
            data = pickle.dumps(_Payload(marker)) if item.filename.endswith("data.pkl") else source.read(item)
            target.writestr(item, data)
    with pytest.raises(UserError, match="holds objects other than tensors"):
        _load_tensor(record(poisoned))
    assert not marker.exists()


def _calls_in(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            yield node, ast.unparse(node.func)


def test_the_sources_read_no_pickle_from_a_file_and_evaluate_nothing():
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        for call, name in _calls_in(ast.parse(path.read_text())):
            where = f"{relative}:{call.lineno} {name}"
            assert name not in ("eval", "exec", "compile", "yaml.load", "marshal.loads"), where
            if name in ("pickle.load", "pickle.loads", "torch.load"):
                keywords = {k.arg: ast.unparse(k.value) for k in call.keywords}
                assert relative in PIPE_MODULES or keywords.get("weights_only") == "True", where
            if name in ("np.load", "numpy.load"):
                assert "allow_pickle" not in {k.arg for k in call.keywords}, where
        for node in ast.walk(ast.parse(path.read_text())):  # an Unpickler only with its own find_class
            if isinstance(node, ast.ClassDef) and "pickle.Unpickler" in map(ast.unparse, node.bases):
                methods = {item.name for item in node.body if isinstance(item, ast.FunctionDef)}
                assert "find_class" in methods, f"{relative}:{node.lineno} {node.name}"


PAYLOAD = "<script>window.pwned = 1</script>[/red][bold]<img src=x onerror=\"window.pwned = 2\">"


def _hostile_steps(**options):
    """The toy model's steps with one layer's module path holding HTML, a script and rich markup."""
    steps = run_toy_model(steps=1, **options)
    rename = lambda text: text.replace("model.layers.1", f"model.{PAYLOAD}")  # noqa: E731
    return [dataclasses.replace(s, calls=[dataclasses.replace(c, name=rename(c.name), module=rename(c.module),
                                                              stack=[rename(f) for f in c.stack]) for c in s.calls])
            for s in steps]


@pytest.fixture
def hostile(tmp_path):
    """Two dumps of the hostile model, B with a fault in the hostile layer; A's manifest names the
    model with the payload too (B's another way: the set-up table shows both)."""
    a = write_dump(tmp_path / "a.h5", _hostile_steps(), manifest=default_manifest(config={"model": PAYLOAD}))
    b = write_dump(tmp_path / "b.h5", _hostile_steps(fault=Fault("model.layers.1/Torch.tanh#0")),
                   manifest=default_manifest(config={"model": "toy"}))
    return a, b


def test_strings_from_a_dump_are_text_in_the_console(hostile, tmp_path):
    a, b = hostile
    code, stderr = pi0align("compare", a, b, "--no-html", "--csv", tmp_path / "rows.csv")
    assert code == 1, stderr
    with open(tmp_path / "rows.csv", newline="") as rows:
        assert any(row["module"] == f"model.{PAYLOAD}" for row in csv.DictReader(rows))


@pytest.mark.browser
def test_strings_from_a_dump_are_text_in_the_html_report(hostile, tmp_path, browser):
    comparison = compare_dumps(*hostile)
    assert comparison.culprits and PAYLOAD in comparison.culprits[0].name
    path = write_html(comparison, tmp_path / "report.html")
    page = browser.new_page()
    errors = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(path.as_uri())
    page.wait_for_selector("#chart-errors .main-svg")
    assert page.evaluate("window.pwned") is None
    assert PAYLOAD in page.inner_text("body")
    assert errors == []
    page.close()


def test_a_dump_naming_files_elsewhere_makes_compare_write_nowhere_else(hostile, tmp_path):
    """Paths inside a dump (its tensor links, a manifest's `out`) decide nothing: the report goes
    where the command line says, or to reports/ under the current folder."""
    a, b = hostile
    elsewhere = tmp_path / "elsewhere"
    shutil.copy(a, tmp_path / "c.h5")
    manifest = default_manifest(config={"model": "toy", "out": str(elsewhere)})
    write_dump(tmp_path / "c.h5", run_toy_model(), manifest=manifest)
    code, stderr = pi0align("compare", tmp_path / "c.h5", tmp_path / "c.h5", "--html", tmp_path / "r.html")
    assert code == 0, stderr
    assert (tmp_path / "r.html").is_file() and not elsewhere.exists()
