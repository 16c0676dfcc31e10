"""Thresholds: defaults, file and command-line overrides, calibration, rounding-level gradients."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pi0align.compare import DEFAULT_THRESHOLDS, calibrate, compare_dumps, load_thresholds, parse_overrides
from pi0align.errors import UserError
from pi0align.testing.dumpfactory import Fault, run_toy_model, write_dump


def test_defaults_are_ordered_by_precision():
    rel = {d: DEFAULT_THRESHOLDS[d]["rel_l2_err"] for d in ("float64", "float32", "float16", "bfloat16")}
    assert rel["float64"] < rel["float32"] < rel["float16"] < rel["bfloat16"]
    assert DEFAULT_THRESHOLDS["integer"]["rel_l2_err"] == 0


def test_file_then_overrides(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"float32": {"rel_l2_err": 1e-5}, "bf16": {"cosine": 0.99}}))
    toml = tmp_path / "t.toml"
    toml.write_text('[float16]\nnorm_rel_err = 0.02\n')
    t = load_thresholds(path, parse_overrides(["fp32.rel_l2_err=3e-5", "fp16.warn_fraction=0.5"]))
    assert t["float32"]["rel_l2_err"] == 3e-5 and t["bfloat16"]["cosine"] == 0.99
    assert t["float16"]["warn_fraction"] == 0.5
    assert load_thresholds(toml)["float16"]["norm_rel_err"] == 0.02
    assert load_thresholds()["float32"]["rel_l2_err"] == DEFAULT_THRESHOLDS["float32"]["rel_l2_err"]  # a copy


@pytest.mark.parametrize("content, overrides, message", [
    (None, {"fp99.rel_l2_err": 1}, "unknown dtype"),
    (None, {"fp32.speed": 1}, "unknown metric"),
    (None, {"fp32.rel_l2_err": "fast"}, "must be a number"),
    (None, {"fp32.rel_l2_err": -1}, "non-negative"),
    (None, {"fp32": 1}, "DTYPE.METRIC=VALUE"),
    ("{broken", {}, "not a valid thresholds file"),
    ('{"float32": 3}', {}, "must map metrics"),
])
def test_bad_thresholds_are_one_line_errors(tmp_path, content, overrides, message):
    path = None
    if content is not None:
        path = tmp_path / "t.json"
        path.write_text(content)
    with pytest.raises(UserError, match=message):
        load_thresholds(path, overrides)
    with pytest.raises(UserError, match="DTYPE.METRIC=VALUE"):
        parse_overrides(["fp32.rel_l2_err"])


@pytest.mark.parametrize("name, content", [("t.toml", b"[float16\n"), ("t.json", b"\xff\xfe{}")])
def test_unparsable_thresholds_files_are_one_line_errors(tmp_path, name, content):
    path = tmp_path / name
    path.write_bytes(content)  # broken TOML; bytes that are not UTF-8
    with pytest.raises(UserError, match="not a valid thresholds file"):
        load_thresholds(path)


def test_calibration_from_two_noisy_runs(tmp_path):
    a1 = write_dump(tmp_path / "a1.h5", run_toy_model(steps=2, noise=3e-6, noise_seed=1), mode="sample")
    a2 = write_dump(tmp_path / "a2.h5", run_toy_model(steps=2, noise=3e-6, noise_seed=2), mode="sample")
    calibrated = calibrate(a1, a2, margin=10)
    seen = compare_dumps(a1, a2).rows["rel_l2_err"].max()
    assert calibrated["float32"]["rel_l2_err"] == pytest.approx(10 * seen)
    assert calibrated["bfloat16"] == DEFAULT_THRESHOLDS["bfloat16"]  # absent dtype keeps its default
    based = calibrate(a1, a2, base=load_thresholds(None, {"bf16.rel_l2_err": 0.1}))
    assert based["bfloat16"]["rel_l2_err"] == 0.1 and based["float32"] == calibrated["float32"]
    with pytest.raises(UserError, match="margin"):
        calibrate(a1, a2, margin=0.5)
    # a third run of the same noise passes with calibrated thresholds; a real fault still fails
    a3 = write_dump(tmp_path / "a3.h5", run_toy_model(steps=2, noise=3e-6, noise_seed=3), mode="sample")
    assert (compare_dumps(a1, a3, thresholds=calibrated).rows["verdict"] != "fail").all()
    faulty = write_dump(tmp_path / "f.h5", run_toy_model(steps=2, noise=3e-6, noise_seed=3,
                                                         fault=Fault("model.layers.0/Torch.tanh#0", scale=1.01)),
                        mode="sample")
    result = compare_dumps(a1, faulty, thresholds=calibrated)
    assert result.first_divergence.name == "model.layers.0/Torch.tanh#0"


def _zero_gradient_run(noise_seed: int, grad_scale: float):
    """A run where the bias gradient of one layer is rounding noise (zero in exact arithmetic),
    and the bias, updated from it, is noise at the next step too."""
    steps = run_toy_model(steps=2, noise=1e-7, noise_seed=noise_seed)
    rng = np.random.default_rng(noise_seed)
    name, bias = "model.layers.0.linear/Functional.linear#0", "model.layers.0.linear.bias/Parameter#0"
    for step in steps:
        noise = (grad_scale * rng.standard_normal(16)).astype(np.float32)
        for call in step.calls:
            if call.name == name and call.direction == "backward":
                call.records[-1] = ("grad_input", 2, noise)
            if call.name == bias:
                call.records[1] = ("parameter_grad", 0, noise)
                if step.step == 1:
                    call.records[0] = ("parameter", 0, (1e-3 * rng.standard_normal(16)).astype(np.float32))
    return steps


def test_rounding_level_gradients_warn_and_are_named(tmp_path):
    a = write_dump(tmp_path / "a.h5", _zero_gradient_run(1, 1e-12))
    b = write_dump(tmp_path / "b.h5", _zero_gradient_run(2, 1e-12))
    result = compare_dumps(a, b)
    assert result.verdict == "aligned"
    assert any("at rounding level" in note and "bias" in note for note in result.notes), result.notes
    bias = result.rows[result.rows["name"].str.contains("layers.0.linear.bias")]
    assert list(bias["verdict"]) == ["pass", "warn", "warn", "warn"]  # step 0 value, step 0 grad, step 1 both
    # the same difference on a gradient of normal size is a failure
    c = write_dump(tmp_path / "c.h5", _zero_gradient_run(2, 1e-1))
    d = write_dump(tmp_path / "d.h5", _zero_gradient_run(3, 1e-1))
    assert compare_dumps(c, d).verdict == "diverged"
