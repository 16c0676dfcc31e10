"""A training run killed with SIGKILL during a dumped step leaves a dump file that opens and holds
every step completed before the kill (LeRobot's PI0, tiny preset)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import h5py
import hdf5plugin  # noqa: F401 - the tensors' Zstandard filter
import numpy as np
import pytest
from conftest import REPO

from pi0align.compare.reading.open_dump import open_run
from pi0align.testing import appender

CHILD = """
import sys
from pathlib import Path
from pi0align import Dumper
from pi0align.train.config import TrainConfig
from pi0align.train.loop import train

class Announcing(Dumper):
    def step(self):
        super().step()
        print(f"dumped {self.current_step - 1}", flush=True)

out = Path(sys.argv[1])
train(TrainConfig(preset="tiny", steps=1000, batch_size=4, threads=1, out=out / "run", progress=False, log_every=0),
      dumper=Announcing(out / "dump", steps=None, level="mix", mode=sys.argv[2], backend=sys.argv[3]))
"""


@pytest.mark.parametrize("backend", ["native", pytest.param("torch", marks=pytest.mark.slow)], indirect=True)
@pytest.mark.parametrize("mode", ["stats", pytest.param("tensor", marks=pytest.mark.slow)])
def test_sigkill_during_a_dumped_step_leaves_every_earlier_step(tmp_path, mode, backend):
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), mode, backend], cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        for line in child.stdout:
            if line.strip() == "dumped 2":
                break
        time.sleep(0.05)  # inside step 3, which is dumped too
        assert child.poll() is None, "the run ended before it could be killed"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert child.returncode == -signal.SIGKILL
    # The writer process outlives the run, finishing the steps handed to it before the kill.
    deadline = time.monotonic() + 60
    while not _holds_steps(tmp_path / "dump", 3) and time.monotonic() < deadline:
        time.sleep(0.1)
    with h5py.File(tmp_path / "dump" / "dump.h5", "r") as f:
        steps = sorted(f["steps"])
        assert steps[:3] == ["000000", "000001", "000002"]
        for step in ("000000", "000001", "000002"):
            group = f[f"steps/{step}"]
            assert group.attrs["complete"] and len(group["records/role"]) > 100
            assert len(group["calls/name"]) == len(group["calls/seq"])
            if mode == "tensor":
                assert group["tensors/0"].size > 0
        assert list(f["metrics/step"][:3]) == [0, 1, 2]


def _holds_steps(folder, count: int) -> bool:
    """Whether the dump file (and, in tensor mode, the tensor files) hold the first `count` steps;
    False while the writer process has the file open."""
    tensors = folder / "dump.h5.tensors"
    if tensors.exists() and not all((tensors / f"{s:06d}.h5").exists() for s in range(count)):
        return False
    try:
        with h5py.File(folder / "dump.h5", "r") as f:
            return all(f"{s:06d}" in f["steps"] for s in range(count)) and len(f["metrics/step"]) >= count
    except (OSError, KeyError):
        return False


def test_a_writer_killed_in_the_middle_of_appends_leaves_every_step_it_finished(tmp_path):
    """SIGKILL at arbitrary moments of a writer appending large steps (most of its time is inside
    an append): each time, the dump opens and holds every step the writer said it had appended,
    each complete."""
    killed_inside_an_append = 0
    for attempt, delay in enumerate(np.random.default_rng(0).uniform(0, 0.2, 12)):
        path = tmp_path / f"{attempt}" / "dump.h5"
        child = appender.start(path, 300, 400, 0)
        time.sleep(delay)
        child.send_signal(signal.SIGKILL)
        appended = max([1, *(int(line.split()[1]) for line in child.stdout)])
        child.wait()
        killed_inside_an_append += (path.parent / "dump.h5.journal").exists()
        (dump,) = open_run(path).values()
        steps = sorted(set(dump.records["step"]))
        assert steps[:appended + 1] == list(range(appended + 1)) and len(steps) <= appended + 2
        assert not dump.notes  # no step left incomplete
        dump.close()
        if killed_inside_an_append >= 3:
            break
    assert killed_inside_an_append >= 3, "the kills did not land inside appends"
