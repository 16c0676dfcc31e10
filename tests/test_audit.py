"""`pi0align audit`: one run judged alone. Where its first NaN/Inf came from (toy models, real PI0
tiny, msprobe's own statistics dumps; stats and tensor mode), and each call against float64 (real
PI0 small: a clean bf16 dump passes, one gelu 2 % off is named, every matmul on TF32 inputs is
one group naming TF32/HF32)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
from conftest import assert_one_line_error, pi0align, run_cli

from pi0align.auditing import audit
from pi0align.testing.scenarios import Emulation, ToyRun, dump_toy

NAN = float("nan")
# (model, the faulted call's module and function, the name the audit must give)
TOY_FAULTS = [("mlp", "blocks.1", "gelu", "blocks.1.2/Functional.gelu#0"),
              ("transformer", "layers.0", "softmax", "layers.0.attention/Torch.softmax#0")]


@pytest.mark.parametrize("mode", ["stats", "tensor"])
@pytest.mark.parametrize(("model", "module", "function", "name"), TOY_FAULTS)
def test_a_nan_made_by_one_call_at_step_1_is_that_call(tmp_path, model, module, function, name, mode):
    run = ToyRun(model=model, mode=mode, device=Emulation(fault=(module, function, 0, NAN), fault_first_forward=2))
    result = audit(dump_toy(tmp_path / "dump", run))
    first = result.culprits[0]
    assert (first.name, first.step, first.kind, first.evidence) == (name, 1, "call", "nonfinite"), result.culprits
    assert result.verdict == "fail" and result.nonfinite == [first]
    assert [c for c in result.culprits if c.name == name and c.evidence == "standard"] == []  # named once
    if mode == "stats":
        assert any("needs full tensors" in note for note in result.notes)


@pytest.mark.parametrize("model", ["mlp", "transformer"])
def test_a_nan_in_the_batch_is_data(tmp_path, model):
    run = ToyRun(model=model, mode="stats", changed_sample_at=1, sample_change=NAN)
    first = audit(dump_toy(tmp_path / "dump", run)).culprits[0]
    assert (first.name, first.step, first.kind) == ("input/Data#0", 1, "data"), first
    assert "batch" in first.bound_by


def test_a_clean_toy_run_passes_and_a_value_near_overflow_is_said_before_it_overflows(tmp_path):
    """A gelu whose results come within 1/16 of float32's largest value (×3e37): said as near
    overflow, at the call that made them, before the Inf a later call makes of them."""
    assert audit(dump_toy(tmp_path / "clean", ToyRun(mode="tensor"))).verdict == "pass"
    near = ToyRun(mode="stats", device=Emulation(fault=("blocks.1", "gelu", 0, 3e37)))  # fp32 max 3.4e38
    result = audit(dump_toy(tmp_path / "near", near))
    assert [(e.name, e.step) for e in result.edges][:1] == [("blocks.1.2/Functional.gelu#0", 0)], result.edges
    assert result.nonfinite and result.nonfinite[0].name != "blocks.1.2/Functional.gelu#0"  # the overflow comes later


def test_the_command_writes_json_and_html_and_bad_input_is_one_line(tmp_path):
    dump = dump_toy(tmp_path / "dump", ToyRun(mode="stats", device=Emulation(
        fault=("blocks.1", "gelu", 0, NAN), fault_first_forward=2)))
    code, stderr = pi0align("audit", dump, "--json", tmp_path / "a.json", "--html", tmp_path / "a.html")
    assert code == 1, stderr
    report = json.loads((tmp_path / "a.json").read_text())
    assert report["verdict"] == "fail" and report["mode"] == "stats"
    assert {k: report["culprits"][0][k] for k in ("name", "step", "kind")} == {
        "name": "blocks.1.2/Functional.gelu#0", "step": 1, "kind": "call"}
    assert "blocks.1.2 · Functional.gelu#0" in (tmp_path / "a.html").read_text()
    (tmp_path / "not-a-dump.h5").write_bytes(b"\x89HDF\r\n\x1a\n but not really")
    for bad in (tmp_path / "not-a-dump.h5", tmp_path / "missing"):
        assert_one_line_error(run_cli("audit", bad))


# -- real PI0 --------------------------------------------------------------------------------------

EXPERT_MLP = "model.paligemma_with_expert.gemma_expert.model.layers.1.mlp"
GELU_CALL = "model.paligemma_with_expert.paligemma.model.language_model.layers.0.mlp.act_fn/Functional.gelu#0"


def _pi0(out, arguments: str):
    return ("-c", "from pi0align.testing.scenarios import Emulation, Pi0Run, dump_pi0; "
            f"dump_pi0({str(out)!r}, Pi0Run({arguments}))")


@pytest.fixture(scope="module")
def pi0_dumps(tmp_path_factory):
    root = tmp_path_factory.mktemp("pi0")
    nan = f"device=Emulation(fault=({EXPERT_MLP!r}, 'gelu', 0, float('nan')), fault_first_forward=2)"
    runs = {"tiny nan stats": f"preset='tiny', dtype='fp32', mode='stats', {nan}",
            "tiny nan tensor": f"preset='tiny', dtype='fp32', mode='tensor', {nan}",
            "tiny batch nan": "preset='tiny', dtype='fp32', mode='stats', batch_nan_at=1",
            "small bf16": "dtype='bf16', mode='tensor', steps=1",
            "small bf16 gelu": "dtype='bf16', mode='tensor', steps=1, device=Emulation(fault=('', 'gelu', 4, 1.02))",
            "small fp32 tf32": "dtype='fp32', mode='tensor', steps=1, device=Emulation(tf32=True)"}
    paths = {name: root / name.replace(" ", "-") for name in runs}
    done = run_python(*(_pi0(paths[name], arguments) for name, arguments in runs.items()))
    for name, result in zip(runs, done):
        assert result.returncode == 0, (name, result.stderr[-3000:])
    return paths


def run_python(*arguments: tuple) -> list[subprocess.CompletedProcess]:
    """Python processes at once, as many as there are cores (each mostly one thread)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor() as pool:
        return list(pool.map(lambda a: subprocess.run([sys.executable, *a], capture_output=True, text=True), arguments))


@pytest.mark.slow  # six PI0 runs, each a process importing torch and LeRobot
@pytest.mark.parametrize("mode", ["stats", "tensor"])
def test_pi0_tiny_a_nan_made_by_the_expert_gelu_at_step_1_is_that_gelu(pi0_dumps, mode):
    first = audit(pi0_dumps[f"tiny nan {mode}"]).culprits[0]
    assert (first.name, first.step, first.kind) == (f"{EXPERT_MLP}.act_fn/Functional.gelu#0", 1, "call"), first
    assert first.stack  # where to look


@pytest.mark.slow
def test_pi0_tiny_a_nan_in_the_batch_is_data(pi0_dumps):
    first = audit(pi0_dumps["tiny batch nan"]).culprits[0]
    assert (first.name, first.step, first.kind) == ("observation.state/Data#0", 1, "data"), first


@pytest.mark.slow
def test_pi0_small_bf16_is_within_its_standard_and_a_gelu_2_percent_off_is_named(pi0_dumps):
    clean = audit(pi0_dumps["small bf16"])
    assert (clean.verdict, clean.culprits, clean.edges) == ("pass", [], []), [c.name for c in clean.culprits]
    assert clean.replayed > 1000
    faulty = audit(pi0_dumps["small bf16 gelu"])
    assert [(c.name, c.step, c.kind) for c in faulty.culprits][:1] == [(GELU_CALL, 0, "call")], faulty.culprits
    assert {c.name for c in faulty.culprits} == {GELU_CALL}  # its backward too, nothing else


@pytest.mark.slow
def test_pi0_small_fp32_with_every_matmul_on_tf32_is_one_group_naming_tf32(pi0_dumps):
    result = audit(pi0_dumps["small fp32 tf32"])
    assert result.verdict == "fail"
    (group,) = result.culprit_groups
    assert group.api == "matmul family" and "TF32" in group.hint and "HF32" in group.hint, group


@pytest.mark.skipif(importlib.util.find_spec("msprobe") is None, reason="mindstudio-probe not installed")
@pytest.mark.slow  # two toy runs under msprobe, each a process
@pytest.mark.parametrize(("level", "name"), [("L1", "/Torch.softmax#0"), ("mix", "layers.0.attention/Torch.softmax#0")])
def test_msprobe_statistics_dump_with_a_nan_planted_names_the_call(tmp_path, level, name):
    code = ("from pi0align.testing.scenarios import Emulation, ToyRun, dump_toy_with_msprobe; "
            f"dump_toy_with_msprobe({str(tmp_path / 'ms')!r}, ToyRun(model='transformer', device=Emulation("
            f"fault=('layers.0', 'softmax', 0, float('nan')), fault_first_forward=2)), level={level!r})")
    (done,) = run_python(("-c", code))
    assert done.returncode == 0, done.stderr[-3000:]
    first = audit(tmp_path / "ms").culprits[0]
    assert (first.name, first.step, first.kind, first.evidence) == (name, 1, "call", "nonfinite"), first

