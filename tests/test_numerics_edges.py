"""Numerics at the edges (docs/reliability.md): NaN and Inf storms, all-zero tensors, denormals and
their flush to zero, values near the dtype's maximum and their overflow, bf16 against fp32 of the
same run: compare ends with a verdict, defined metrics and not one warning, in stats and tensor
mode."""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest

from pi0align.compare import compare_dumps
from pi0align.testing.dumpfactory import run_toy_model, write_dump
from pi0align.testing.scenarios import ToyRun, dump_toy

TARGET = "model.layers.1/Torch.tanh#0"
SAME = lambda v: v  # noqa: E731
CASES = {  # name: (A's output of TARGET, B's, whether the runs differ)
    "NaN storm on one side": (SAME, lambda v: np.full_like(v, np.nan), True),
    "Inf on both sides": (lambda v: np.where(np.arange(v.size).reshape(v.shape) % 3 == 0, np.inf, v),) * 2 + (False,),
    "all zeros on both sides": (np.zeros_like,) * 2 + (False,),
    "all zeros against values": (np.zeros_like, SAME, True),
    "denormals on both sides": (lambda v: (v * 1e-42).astype(np.float32),) * 2 + (False,),
    "denormals against their flush to zero": (lambda v: (v * 1e-42).astype(np.float32), np.zeros_like, True),
    "near float32's maximum on both sides": (lambda v: (v * 3e38).astype(np.float32),) * 2 + (False,),
    "near the maximum against its overflow": (lambda v: (v * 3e38).astype(np.float32),
                                              lambda v: np.where(v > 0.9, np.inf, v * 3e38).astype(np.float32), True),
}


def _with_output(change):
    """The toy model's step with TARGET's output changed (what follows computed from the original)."""
    steps = run_toy_model(steps=1)
    return [dataclasses.replace(s, calls=[
        dataclasses.replace(c, records=[(role, i, change(v) if role == "output" else v) for role, i, v in c.records])
        if c.name == TARGET else c for c in s.calls]) for s in steps]


@pytest.mark.parametrize("mode", ["stats", "tensor"])
@pytest.mark.parametrize("case", CASES)
def test_edge_values_get_a_verdict_defined_metrics_and_no_warning(tmp_path, case, mode):
    change_a, change_b, differ = CASES[case]
    with np.errstate(over="ignore"):
        a = write_dump(tmp_path / "a.h5", _with_output(change_a), mode=mode)
        b = write_dump(tmp_path / "b.h5", _with_output(change_b), mode=mode)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        comparison = compare_dumps(a, b)
    assert comparison.verdict == ("diverged" if differ else "aligned")
    if differ:
        assert comparison.first_divergence.name == TARGET
    rows = comparison.rows
    row = rows[(rows["name"] == TARGET) & (rows["role"] == "output")].iloc[0]
    assert row["verdict"] == ("fail" if differ else "pass")
    if mode == "tensor" and not differ:
        assert row["max_abs_err"] == 0 and row["cosine"] == pytest.approx(1.0)


def test_bf16_against_fp32_of_the_same_run_pairs_dtypes_and_warns_nothing(tmp_path):
    fp32 = dump_toy(tmp_path / "fp32", ToyRun(dtype="fp32"))
    bf16 = dump_toy(tmp_path / "bf16", ToyRun(dtype="bf16"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        comparison = compare_dumps(fp32, bf16)
    rows = comparison.rows
    mismatched = rows[rows["pairing"] == "dtype_mismatch"]
    assert len(mismatched) > 0 and np.isfinite(mismatched["cosine"].astype(float)).any()
    assert comparison.verdict in ("aligned", "diverged")
