"""A comparison streams: a tensor dump several times larger than the memory the compare process is
given (its address space limited with prlimit) is compared to completion, with the right verdict;
within a step, each record costs a bounded amount."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from pi0align.testing.dumpfactory import Call, Step, run_toy_model, write_dump

LIMIT_MIB = 640  # address space of the compare process: Python, numpy, h5py and their threads
TENSORS = 16  # of 64 MiB each a side: 2 GiB in all, 3 × the limit


def _dump(path, faulty: bool):
    """A chain of linear calls, each reading the output of the one before, float32; B's eighth
    output 1e-3 off."""
    rng = np.random.default_rng(0)
    value = rng.standard_normal((1 << 12, 1 << 12), dtype=np.float32)
    calls = []
    for i in range(TENSORS // 2):
        output = np.tanh(value * np.float32(1.1), dtype=np.float32)
        if faulty and i == 7:
            output *= np.float32(1 + 1e-3)
        calls.append(Call(f"model.layers.{i}/Functional.linear#0", f"model.layers.{i}", "Functional.linear",
                          "forward", [("input", 0, value), ("output", 0, output)]))
        value = output
    return write_dump(path, [Step(0, calls, 0.0, 0.0, 0.0)], mode="tensor")


@pytest.mark.slow  # 2 GiB written and read
@pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs util-linux's prlimit")
def test_a_dump_several_times_larger_than_the_memory_given_is_compared(tmp_path):
    a, b = _dump(tmp_path / "a.h5", False), _dump(tmp_path / "b.h5", True)
    assert 2 * TENSORS * (64 << 20) >= 3 * (LIMIT_MIB << 20)  # the tensors both sides hold, raw
    script = ("import json, sys; from pi0align.compare import compare_dumps; "
              "r = compare_dumps(sys.argv[1], sys.argv[2], replay=False); "
              "print(json.dumps([r.verdict, r.first_divergence.name if r.first_divergence else None]))")
    done = subprocess.run(["prlimit", f"--as={LIMIT_MIB << 20}", sys.executable, "-c", script, str(a), str(b)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout) == ["diverged", "model.layers.7/Functional.linear#0"]


def _peak_mib(a, b) -> int:
    """The peak resident memory of a compare of a and b, in a process of its own."""
    script = ("import sys; from pi0align.compare import compare_dumps; compare_dumps(sys.argv[1], sys.argv[2]); "
              "print(next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM')) >> 10)")
    done = subprocess.run([sys.executable, "-c", script, str(a), str(b)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout)


def test_a_step_s_records_cost_the_compare_under_two_kilobytes_each(tmp_path):
    """Within a step, every record is held (windows.py, ROWS_PER_WINDOW): its rows, the call table
    and the judging of each (docs/compare.md, Memory). 2 KB a record is a step of 500k records
    in 1 GiB; the toy's steps of 22k and 88k records are measured (noisy runs: every stage runs)."""
    peaks = {}
    for layers in (1_000, 4_000):
        dumps = []
        for side, noise_seed in (("a", 1), ("b", 2)):
            steps = run_toy_model(layers=layers, width=8, noise=1e-7, noise_seed=noise_seed)
            dumps.append(write_dump(tmp_path / f"{side}{layers}.h5", steps))
        records = sum(len(call.records) for call in steps[0].calls)
        peaks[records] = _peak_mib(*dumps)
    (small, small_peak), (large, large_peak) = sorted(peaks.items())
    assert (large_peak - small_peak) * 1024 / (large - small) < 2.0, peaks
