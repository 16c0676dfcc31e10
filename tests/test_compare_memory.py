"""A comparison streams: a tensor dump several times larger than the memory the compare process is
given (its address space limited with prlimit) is compared to completion, with the right verdict."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from pi0align.testing.dumpfactory import Call, Step, write_dump

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
