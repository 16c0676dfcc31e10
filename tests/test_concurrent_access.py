"""Concurrency (docs/reliability.md): two compares of the same dumps, and compares of a dump while
its writer appends to it: correct results for the complete steps, or one "being written" line."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest
from conftest import REPO, pi0align

from pi0align.compare.reading import read_ours
from pi0align.testing import appender
from pi0align.testing.dumpfactory import Fault, run_toy_model, write_dump


def test_two_compares_of_the_same_dumps_at_once_give_the_same_answer(tmp_path):
    a = write_dump(tmp_path / "a.h5", run_toy_model(steps=2), mode="tensor")
    b = write_dump(tmp_path / "b.h5", run_toy_model(steps=2, fault=Fault("model.layers.1/Torch.tanh#0")),
                   mode="tensor")
    compares = [subprocess.Popen([sys.executable, "-m", "pi0align.cli.main", "compare", str(a), str(b), "--no-html",
                                  "--json", str(tmp_path / f"{i}.json")], cwd=REPO,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for i in range(2)]
    results = [(c.wait(timeout=300), c.stderr.read()) for c in compares]
    assert [code for code, _ in results] == [1, 1], results
    first, second = (json.loads((tmp_path / f"{i}.json").read_text()) for i in range(2))
    assert first["verdict"] == second["verdict"] == "diverged"
    assert first["first_divergence"] == second["first_divergence"]
    assert first["first_divergence"]["name"] == "model.layers.1/Torch.tanh#0"


@pytest.fixture
def appending(tmp_path):
    """A writer appending a step of a 600-layer toy model (about 13,000 records) every 50 ms or so,
    for longer than a test takes: ended by the fixture."""
    path = tmp_path / "written" / "dump.h5"
    child = appender.start(path, 600, 1000, 0.02)
    yield child, path
    child.kill()
    child.wait()


def test_a_dump_compared_while_it_is_written_is_right_about_its_complete_steps(appending, tmp_path):
    child, path = appending
    reference = write_dump(tmp_path / "reference.h5", run_toy_model(layers=600))
    for _ in range(3):
        code, stderr = pi0align("compare", reference, path, "--steps", "0", "--no-html")
        assert code == 0, stderr  # aligned: step 0 the same, whatever else is being written
    assert child.poll() is None, "the writer finished before the compares could overlap it"


def test_a_dump_whose_writer_stopped_inside_an_append_is_one_being_written_line(appending, tmp_path, monkeypatch):
    child, path = appending
    appender.stop_inside_an_append(child, path)
    monkeypatch.setattr(read_ours, "LOCK_WAIT_S", 0.5)
    try:
        code, stderr = pi0align("compare", path, path, "--no-html")
    finally:
        child.send_signal(signal.SIGCONT)
    assert code == 2 and len(stderr.strip().splitlines()) == 1 and "being written" in stderr, stderr
    assert path.name in stderr
    monkeypatch.undo()
    code, stderr = pi0align("compare", path, path, "--steps", "0-1", "--no-html")  # once the append is done
    assert code == 0, stderr
