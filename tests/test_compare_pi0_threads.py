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


def test_run_records_the_batch_and_the_optimizer_update_of_every_parameter(thread_runs):
    """`pi0align run --dump-steps` alone records PI0's processed batch as data and AdamW's update of
    each trained parameter: the same names on both runs, none of them blamed for thread noise."""
    from pi0align.compare.reading.open_dump import open_run

    records = open_run(thread_runs[1], None)[0].records
    names = set(records["name"][records["direction"] == "data"].tolist())
    assert {"observation.state/Data#0", "action/Data#0"} <= names
    updated = set(records["name"][records["direction"] == "optimizer"].tolist())
    trained = {name.replace("/Parameter#0", "/Optimizer.step#0")
               for name, role in zip(records["name"].tolist(), records["role"].tolist()) if role == "parameter_grad"}
    assert updated == trained and len(updated) > 10  # tiny PI0: 66 trained tensors
    result = compare_dumps(thread_runs[2], thread_runs[1])
    assert not [c for c in result.culprits if c.kind != "call"]
