"""Resources (docs/reliability.md): a read-only output folder is one line before any work, for every
command that writes; dumps on a read-only file system are read. (A full disk while dumping:
test_dump_errors.py; a dump larger than the memory given to compare: test_compare_memory.py.)"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess

import pytest
from conftest import assert_one_line_error, pi0align, run_cli

from pi0align.testing import appender
from pi0align.testing.dumpfactory import run_toy_model, write_dump


@contextlib.contextmanager
def made_read_only(folder):
    """The folder read-only: a read-only bind mount as root (whom permissions do not stop), its
    permissions otherwise."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        try:
            yield folder
        finally:
            folder.chmod(0o755)
        return
    if subprocess.run(["mount", "--bind", "-o", "ro", folder, folder], capture_output=True).returncode != 0:
        pytest.skip("root without a read-only bind mount (no CAP_SYS_ADMIN): nothing here is read-only to it")
    try:
        yield folder
    finally:
        subprocess.run(["umount", folder], check=True)


@pytest.fixture
def read_only(tmp_path):
    """A read-only folder holding a tensor dump."""
    folder = tmp_path / "read-only"
    write_dump(folder / "dump.h5", run_toy_model(steps=2), mode="tensor")
    with made_read_only(folder):
        yield folder


@pytest.mark.parametrize("command", [
    ("compare", "{dump}", "{dump}", "--html", "{ro}/report.html"),
    ("compare", "{dump}", "{dump}", "--no-html", "--csv", "{ro}/rows.csv"),
    ("compare", "{dump}", "{dump}", "--no-html", "--json", "{ro}/new/summary.json"),
    ("env-diff", "{dump}", "{dump}", "--json", "{ro}/env.json"),
    ("check", "{run}", "--save-baseline", "x", "--baselines", "{ro}/baselines"),
])
def test_an_output_in_a_read_only_folder_is_one_line(read_only, tmp_path, command):
    dump = tmp_path / "dump.h5"
    shutil.copy(read_only / "dump.h5", dump)
    shutil.copytree(read_only / "dump.h5.tensors", tmp_path / "dump.h5.tensors")
    run = tmp_path / "run"
    run.mkdir()
    (run / "train_log.jsonl").write_text('{"step": 0, "loss": 1.0}\n')
    code, stderr = pi0align(*(part.format(dump=dump, ro=read_only, run=run) for part in command))
    assert code == 2 and len(stderr.strip().splitlines()) == 1, stderr
    assert "cannot write" in stderr and str(read_only) in stderr
    assert sorted(os.listdir(read_only)) == ["dump.h5", "dump.h5.tensors"]  # nothing written, nothing lost


def test_a_run_into_a_read_only_folder_is_one_line_before_training(read_only):
    assert_one_line_error(run_cli("run", "--preset", "tiny", "--steps", "1", "--out", read_only / "run"),
                          "cannot write", "read-only")


def test_a_dump_on_a_read_only_file_system_is_compared(read_only):
    code, stderr = pi0align("compare", read_only / "dump.h5", read_only / "dump.h5", "--no-html")
    assert code == 0, stderr


def test_a_dump_left_mid_append_on_a_read_only_file_system_is_one_line_then_restored(tmp_path):
    folder = tmp_path / "killed"
    path = folder / "dump.h5"
    writer = appender.start(path, 300, 400, 0.02)
    appender.stop_inside_an_append(writer, path)  # then killed there
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    with made_read_only(folder):
        code, stderr = pi0align("compare", path, path, "--no-html")
        assert code == 2 and len(stderr.strip().splitlines()) == 1, stderr
        assert "killed in the middle of an append" in stderr and "write access" in stderr
    code, stderr = pi0align("compare", path, path, "--steps", "0-1", "--no-html")
    assert code == 0, stderr
    assert not (folder / "dump.h5.journal").exists()
