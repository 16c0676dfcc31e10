"""Acceptance of compare_dumps on real HDF5 dumps of a toy model that really propagates errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pi0align.compare import ROW_COLUMNS, compare_dumps, load_thresholds
from pi0align.errors import UserError
from pi0align.testing.dumpfactory import Fault, default_manifest, run_toy_model, write_dump

MODES = ["stats", "sample", "tensor"]
NOISE = dict(noise=1e-7, steps=2)  # reduction-order noise of float32: two runs never agree bit for bit
FAULTY = "model.layers.1.linear/Functional.linear#0"

pytestmark = pytest.mark.filterwarnings("error")  # no warning spam on any input


def make(tmp_path, name, mode="stats", noise_seed=1, **kwargs):
    """A dump whose noise, when it has some, stands for another thread count, as its manifest says."""
    options = {**NOISE, **kwargs}
    manifest = default_manifest(numerics={"threads": noise_seed}) if options["noise"] else None
    return write_dump(tmp_path / f"{name}.h5", run_toy_model(noise_seed=noise_seed, **options), mode=mode,
                      manifest=manifest)


@pytest.mark.parametrize("mode", MODES)
def test_same_run_twice_is_aligned(tmp_path, mode):
    result = compare_dumps(make(tmp_path, "a", mode), make(tmp_path, "b", mode, noise_seed=2))
    assert result.verdict == "aligned"
    assert (result.rows["verdict"] == "fail").sum() == 0
    assert result.first_divergence is None and result.culprits == []
    assert result.coverage["only_a"] == result.coverage["only_b"] == 0
    assert list(result.rows.columns) == ROW_COLUMNS
    assert set(result.rows["evidence"]) == {mode}


# zero-mean noise keeps the statistics: stats mode is given the scaled fault only
FAULT_CASES = [(mode, Fault(FAULTY)) for mode in MODES] + [(mode, Fault(FAULTY, scale=1.0, noise=3e-3))
                                                          for mode in ("sample", "tensor")]


@pytest.mark.parametrize("mode, fault", FAULT_CASES, ids=[f"{m}-{'noised' if f.noise else 'scaled'}"
                                                          for m, f in FAULT_CASES])
def test_injected_fault_is_first_divergence_and_top_culprit(tmp_path, mode, fault):
    result = compare_dumps(make(tmp_path, "a", mode), make(tmp_path, "b", mode, noise_seed=2, fault=fault))
    assert result.verdict == "diverged"
    assert result.first_divergence.name == FAULTY and result.first_divergence.direction == "forward"
    top = result.culprits[0]
    assert (top.step, top.name, top.direction, top.module) == (0, FAULTY, "forward", "model.layers.1.linear")
    assert top.introduced_error > 100 and top.stack[-1].startswith("toy_model.py:")
    # everything before the fault passes; the fault's downstream fails but is not blamed
    rows = result.rows[result.rows["step"] == 0]
    faulty_seq = rows.loc[rows["name"] == FAULTY, "seq_a"].iloc[0]
    assert (rows.loc[(rows["direction"] == "forward") & (rows["seq_a"] < faulty_seq), "verdict"] != "fail").all()
    assert FAULTY not in {c.name for c in result.culprits[1:] if c.step == 0 and c.direction == "forward"}


def test_backward_fault_found_in_backward_order(tmp_path):
    fault = Fault("model.layers.2/Torch.tanh#0", direction="backward")
    result = compare_dumps(make(tmp_path, "a"), make(tmp_path, "b", noise_seed=2, fault=fault))
    assert result.verdict == "diverged"
    assert result.first_divergence_backward.name == "model.layers.2/Torch.tanh#0"
    assert result.first_divergence.direction == "backward"  # no forward call differs at step 0
    assert result.culprits[0].name == "model.layers.2/Torch.tanh#0"


@pytest.mark.parametrize("mode", MODES)
def test_different_seeds_diverge(tmp_path, mode):
    result = compare_dumps(make(tmp_path, "a", mode), make(tmp_path, "b", mode, seed=7))
    assert result.verdict == "diverged"
    first = result.first_divergence
    assert (first.kind, first.direction, first.step) == ("initial_weights", "parameter", 0)
    assert result.culprit_groups[0].kind == "initial_weights"


def test_different_data_diverges_in_stats_mode(tmp_path):
    """The factory's dumps record no batch and hold no checksums: the model's inputs that no dumped
    call produced stand for it, named after the first call that read them."""
    result = compare_dumps(make(tmp_path, "a"), make(tmp_path, "b", data_seed=3))
    assert result.verdict == "diverged"
    first = result.first_divergence
    assert (first.kind, first.name, first.step) == ("data", "model.layers.0.linear/Functional.linear#0/input 0", 0)
    assert result.culprit_groups[0].kind == "data"


def test_different_weights_in_manifest_is_never_aligned(tmp_path):
    steps = run_toy_model(**NOISE)
    a = write_dump(tmp_path / "a.h5", steps, manifest=default_manifest(weights_sha256="a" * 64))
    b = write_dump(tmp_path / "b.h5", steps, manifest=default_manifest(weights_sha256="b" * 64))
    result = compare_dumps(a, b)
    assert result.verdict == "diverged"
    assert any(note.startswith("initial weights differ") for note in result.notes)
    assert ("weights_sha256", "a" * 64, "b" * 64) in result.manifest_diff


@pytest.mark.parametrize("mode", MODES)
def test_extra_noop_call_is_one_sided_and_nothing_is_mispaired(tmp_path, mode):
    noop_module = "model.layers.1"
    result = compare_dumps(make(tmp_path, "a", mode), make(tmp_path, "b", mode, noise_seed=2, extra_noop=noop_module))
    rows = result.rows
    assert result.verdict == "aligned"
    only_b = rows[rows["pairing"] == "only_b"]
    # per step: the no-op's two inputs and one output, nothing else
    assert len(only_b) == 2 * 3 and set(only_b["seq_b"].groupby(only_b["step"]).nunique()) == {1}
    assert (only_b["module"] == noop_module).all() and result.coverage["only_a"] == 0
    # the real residual add was renamed #1 on B and must pair with A's #0, forward and backward
    realigned = rows[rows["pairing"] == "realigned"]
    assert set(realigned["name"]) == {f"{noop_module}/Tensor.__add__#0"}
    assert (rows.loc[rows["pairing"] != "only_b", "verdict"] == "pass").all()


def test_rows_and_training_metrics_read_as_dataframes(tmp_path):
    import pandas as pd

    result = compare_dumps(make(tmp_path, "a"), make(tmp_path, "b", noise_seed=2, extra_noop="model.layers.1"))
    rows = result.rows
    assert isinstance(rows, pd.DataFrame) and list(rows.columns) == ROW_COLUMNS
    assert str(rows["seq_a"].dtype) == "Int64" and int(rows["seq_a"].isna().sum()) == 6  # the no-op's, B only
    assert list(result.metrics_a.columns) == ["step", "loss", "grad_norm", "lr"]
    assert list(result.metrics_b["step"]) == [0, 1]
    rows.loc[0, "verdict"] = "fail"  # the DataFrame is the comparison's rows from now on
    assert result.table()["verdict"][0] == "fail"


def test_nan_and_inf_on_both_sides_agree_and_on_one_side_fail(tmp_path):
    for scale, name in ((np.inf, "inf"), (np.nan, "nan"), (0.0, "zero")):
        fault = Fault(FAULTY, scale=scale)
        # identical runs: saturated tanh turns any rounding noise into a real difference downstream
        both = compare_dumps(make(tmp_path, f"a{name}", "tensor", fault=fault),
                             make(tmp_path, f"b{name}", "tensor", fault=fault))
        assert both.verdict == "aligned", name
        if name != "zero":
            one = compare_dumps(make(tmp_path, "clean", "tensor"), make(tmp_path, f"c{name}", "tensor", fault=fault))
            assert one.verdict == "diverged" and one.first_divergence.name == FAULTY, name
            assert one.rows["nan_inf_mismatch"].max() > 0


def test_single_element_and_scalar_records_are_compared(tmp_path):
    result = compare_dumps(make(tmp_path, "a", "tensor", width=1, batch=1),
                           make(tmp_path, "b", "tensor", noise_seed=2, width=1, batch=1))
    assert result.verdict == "aligned"
    loss = result.rows[(result.rows["api"] == "Functional.mse_loss") & (result.rows["role"] == "output")]
    assert (loss["shape_a"] == "[]").all() and loss["rel_l2_err"].notna().all()


def test_dtype_and_shape_changes_are_kept_and_labelled(tmp_path):
    steps_a, steps_b = run_toy_model(**NOISE), run_toy_model(noise_seed=2, **NOISE)
    call = next(c for c in steps_b[0].calls if c.name == "model.layers.0/Torch.tanh#0" and c.direction == "forward")
    call.records[-1] = ("output", 0, call.records[-1][2].astype(np.float16))  # e.g. a half-precision kernel
    call = next(c for c in steps_b[0].calls if c.name == "model.layers.2/Torch.tanh#0" and c.direction == "forward")
    call.records[-1] = ("output", 0, call.records[-1][2].reshape(-1))  # e.g. a fused op's flat output
    result = compare_dumps(write_dump(tmp_path / "a.h5", steps_a, mode="tensor"),
                           write_dump(tmp_path / "b.h5", steps_b, mode="tensor"))
    rows = result.rows
    dtype_row = rows[rows["pairing"] == "dtype_mismatch"]
    assert list(dtype_row["name"]) == ["model.layers.0/Torch.tanh#0"]
    assert dtype_row["verdict"].iloc[0] != "fail"  # judged by float16's thresholds: no false alarm
    shape_row = rows[rows["pairing"] == "shape_mismatch"]
    assert list(shape_row["name"]) == ["model.layers.2/Torch.tanh#0"] and shape_row["verdict"].iloc[0] == "n/a"
    assert result.coverage["only_a"] == result.coverage["only_b"] == 0


def test_bfloat16_tensors_stored_as_bits_are_read(tmp_path):
    steps = run_toy_model(**NOISE)
    paths = []
    for name, scale in (("a", 1.0), ("b", 1.01)):
        path = write_dump(tmp_path / f"{name}.h5", steps, mode="tensor")
        with __import__("h5py").File(path, "r+") as f:
            records = f["steps/000000/records"]
            values = f["steps/000000/tensors/0"][()] * scale
            del f["steps/000000/tensors/0"]
            ds = f["steps/000000"].create_dataset("tensors/0", data=(values.view(np.uint32) >> 16).astype(np.uint16))
            ds.attrs["dtype"] = "bfloat16"
            dtypes = records["dtype"].asstr()[()].tolist()
            dtypes[0] = "bfloat16"
            del records["dtype"]  # short str columns are fixed-length: rewritten whole
            records.create_dataset("dtype", data=dtypes, dtype=__import__("h5py").string_dtype())
            del ds, records  # the tensor file they lie in (an external link's) closes with them
        paths.append(path)
    row = compare_dumps(*paths).rows.query("step == 0").iloc[0]
    assert row["dtype_a"] == "bfloat16" and row["evidence"] == "tensor"
    assert 0.005 < row["rel_l2_err"] < 0.015  # 1% apart, up to bf16 rounding


def test_ranks_of_run_folders_pair_by_number(tmp_path):
    for run, seed in (("a", 1), ("b", 2)):
        for rank in (0, 1):
            fault = Fault(FAULTY) if run == "b" and rank == 1 else None
            write_dump(tmp_path / run / f"dump-rank{rank}.h5", run_toy_model(noise_seed=seed, fault=fault, **NOISE),
                       rank=rank, world_size=2, manifest=default_manifest(rank=rank, world_size=2))
    result = compare_dumps(tmp_path / "a", tmp_path / "b")
    assert set(result.rows["rank"]) == {0, 1}
    assert result.first_divergence.rank == 1 and result.first_divergence.name == FAULTY
    assert (result.rows.loc[result.rows["rank"] == 0, "verdict"] != "fail").all()
    (tmp_path / "b" / "dump-rank1.h5").unlink()
    with pytest.raises(UserError, match="different ranks"):
        compare_dumps(tmp_path / "a", tmp_path / "b")


def test_steps_filter_and_progress(tmp_path):
    calls = []
    result = compare_dumps(make(tmp_path, "a", "tensor"), make(tmp_path, "b", "tensor", noise_seed=2), steps=[1],
                           progress=lambda done, total: calls.append((done, total)))
    assert set(result.rows["step"]) == {1}
    assert calls and calls[-1][0] == calls[-1][1] and [d for d, _ in calls] == sorted(d for d, _ in calls)


def test_thresholds_decide_the_verdict(tmp_path):
    a, b = make(tmp_path, "a"), make(tmp_path, "b", noise_seed=2, fault=Fault(FAULTY))
    loose = load_thresholds(None, {f"fp32.{m}": 5e-3 for m in ("rel_l2_err", "norm_rel_err", "mean_val_rel_err",
                                                                 "min_rel_err", "max_val_rel_err")})
    result = compare_dumps(a, b, thresholds=loose)
    assert result.verdict == "aligned" and (result.rows["verdict"] == "warn").any()
    assert result.thresholds["float32"]["rel_l2_err"] == 5e-3


def test_incomplete_step_is_skipped_with_a_note(tmp_path):
    a = write_dump(tmp_path / "a.h5", run_toy_model(**NOISE))
    b = write_dump(tmp_path / "b.h5", run_toy_model(noise_seed=2, **NOISE))
    with __import__("h5py").File(b, "r+") as f:
        f["steps/000001"].attrs["complete"] = False
    result = compare_dumps(a, b)
    assert any("step 1 is incomplete" in note for note in result.notes)
    assert result.coverage["only_a"] > 0 and result.coverage["matched"] > 0
    assert set(result.rows.query("pairing == 'only_a'")["step"]) == {1}
    json.dumps(result.notes)  # plain strings
