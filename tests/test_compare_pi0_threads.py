"""End to end on real PI0 dumps: 2 threads against 1 thread is reduction-order noise only.

Runs `pi0align run` (tiny PI0 preset, CPU) twice, dumping steps 0 and 1 in sample mode.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from pi0align.compare import calibrate, compare_dumps

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def thread_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pi0")
    paths = {}
    for threads in (2, 1):
        out = root / f"threads{threads}"
        command = [sys.executable, "-m", "pi0align.cli.main", "run", "--preset", "tiny", "--steps", "2",
                   "--dump-steps", "0,1", "--dump-mode", "sample", "--threads", str(threads), "--out", str(out),
                   "--no-progress"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            pytest.fail(f"pi0align run failed: {done.stderr[-2000:]}")
        paths[threads] = out
    return paths


def test_thread_noise_passes_default_fp32_thresholds(thread_runs):
    result = compare_dumps(thread_runs[2], thread_runs[1])
    rows = result.rows
    assert result.verdict == "aligned", result.notes
    assert (rows["verdict"] == "fail").sum() == 0
    assert result.coverage["only_a"] == result.coverage["only_b"] == 0 and result.coverage["matched"] > 1000
    assert set(rows["evidence"]) == {"sample"}
    # the runs really differ (reduction order), so the test is not vacuous
    assert rows["rel_l2_err"].max() > 0


def test_thread_noise_passes_calibrated_thresholds(thread_runs):
    calibrated = calibrate(thread_runs[2], thread_runs[1])
    assert calibrated["float32"]["rel_l2_err"] > 0
    result = compare_dumps(thread_runs[2], thread_runs[1], thresholds=calibrated)
    assert (result.rows["verdict"] == "fail").sum() == 0 and result.verdict == "aligned"
