"""Replay of dumped calls in float64: each side's local error, from the dumps alone; names that
cannot run code; calls that cannot be replayed say why, and the compare goes on."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import assert_one_line_error, run_cli

from pi0align.replay import RecordedCall, replay
from pi0align.testing.scenarios import Emulation, ToyRun, dump_toy

GELU = "blocks.2.2/Functional.gelu#0"


@pytest.fixture(scope="module")
def toy_dumps(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("replay")
    runs = {"a": ToyRun(dtype="bf16"), "noisy": ToyRun(dtype="bf16", device=Emulation(ulp_noise=1)),
            "faulty": ToyRun(dtype="bf16", device=Emulation(ulp_noise=1, fault=("blocks.2.2", "gelu", 0, 1.03))),
            "stats": ToyRun(dtype="bf16", mode="stats")}
    return {name: dump_toy(root / name, run) for name, run in runs.items()}


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_an_unchanged_call_is_within_rounding_on_both_sides(toy_dumps, direction):
    done = run_cli("replay", toy_dumps["a"], GELU, "--against", toy_dumps["noisy"], "--direction", direction)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "both within noise of each other" in done.stdout
    errors = _errors(done.stdout)
    assert errors and all(0 < e < 3 * 2.0**-8 for e in errors)  # a few bf16 unit roundoffs at most


def test_a_faulted_call_names_the_faulted_side(toy_dumps):
    done = run_cli("replay", toy_dumps["a"], GELU, "--against", toy_dumps["faulty"])
    assert done.returncode == 1 and "B is wrong" in done.stdout, done.stdout
    reverse = run_cli("replay", toy_dumps["faulty"], GELU, "--against", toy_dumps["a"])
    assert reverse.returncode == 1 and "A is wrong" in reverse.stdout, reverse.stdout
    error_a, error_b = _errors(done.stdout)
    assert error_a < 2.0**-8 and 0.02 < error_b < 0.04  # the fault is 3 %


def test_replay_needs_full_tensors_and_a_known_call(toy_dumps):
    assert_one_line_error(run_cli("replay", toy_dumps["stats"], GELU), "needs full tensors")
    assert_one_line_error(run_cli("replay", toy_dumps["a"], "blocks.9/Functional.gelu#0"), "no forward call")
    assert_one_line_error(run_cli("replay", toy_dumps["a"], "blocks.2.2/Module.GELU#0"),
                          "cannot be replayed", "module call")


def _errors(stdout: str) -> list[float]:
    """The local errors of result 0 in the printed table."""
    row = next(line for line in stdout.splitlines() if line.strip().strip("│").strip().startswith("0 "))
    return [float(cell) for cell in row.replace("│", " ").split()[1:]]


def _call(api: str, args: dict, inputs: list[np.ndarray], outputs: list[np.ndarray]) -> RecordedCall:
    return RecordedCall(api, json.dumps(args), dict(enumerate(inputs)), dict(enumerate(outputs)))


def test_names_resolve_only_to_torch_maths():
    x = np.ones((2, 2), np.float32)
    for api in ("Torch.load", "Torch.save", "Torch.from_file", "Tensor.__reduce_ex__", "Torch.os",
                "Functional.torch", "Tensor.__class__", "os.system", "Torch.compile", "Torch.hub"):
        result = replay(_call(api, {"args": [{"tensor": 0}], "kwargs": {}}, [x], [x]))
        assert not result and result.reason, api
    # an argument that would need code to rebuild is refused, not evaluated
    evil = {"args": [{"tensor": 0}, {"repr": "__import__('os').system('touch /tmp/pwned')"}], "kwargs": {}}
    assert "cannot be rebuilt" in replay(_call("Tensor.add", evil, [x], [x])).reason


@pytest.mark.parametrize("api, reason", [("Functional.dropout", "random op"), ("NPU.npu_rms_norm", "no CPU kernel"),
                                         ("Module.Linear", "module call")])
def test_calls_that_cannot_be_replayed_say_why(api, reason):
    x = np.ones((2, 2), np.float32)
    assert reason in replay(_call(api, {"args": [{"tensor": 0}], "kwargs": {}}, [x], [x])).reason


def test_replay_rebuilds_slices_dtypes_and_in_place_writes():
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    index = {"args": [{"tensor": 0}, [{"repr": "slice(None, 2, None)"}, 1]], "kwargs": {}}
    assert replay(_call("Tensor.__getitem__", index, [x.numpy()], [x[:2, 1].numpy()])).errors == {0: 0.0}
    softmax = {"args": [{"tensor": 0}, -1], "kwargs": {"dtype": {"repr": "torch.float32"}}}
    expected = torch.softmax(x.double(), -1).float().numpy()
    assert replay(_call("Torch.softmax", softmax, [x.numpy()], [expected])).errors[0] < 1e-7
    written = x.clone()
    written[0] = 0.0
    setitem = {"args": [{"tensor": 0}, 0, {"tensor": 1}], "kwargs": {}}
    assert replay(_call("Tensor.__setitem__", setitem, [x.numpy(), np.zeros(4, np.float32)],
                        [written.numpy()])).errors == {0: 0.0}


def test_the_compare_goes_on_where_replay_cannot(toy_dumps):
    from pi0align.compare import compare_dumps

    result = compare_dumps(toy_dumps["a"], toy_dumps["noisy"])
    rows = result.rows
    assert result.noise_model == "replay" and result.verdict == "aligned"
    reasons = set(rows.loc[rows["replay"] != "", "replay"])
    assert reasons == {"module call (judged by the calls inside it)"}
    replayed = rows[rows["local_error_a"].notna()]
    kernels = replayed["direction"].isin(["forward", "backward"])  # one operation each: within its rounding
    assert kernels.sum() > 50 and (replayed.loc[kernels, "local_error_b"] < 3 * 2.0**-8).all()
    updates = replayed[~kernels]  # AdamW's update is several operations, each moved by up to an ulp on B
    assert len(updates) > 20 and updates["direction"].eq("optimizer").all()
    assert (updates["local_error_b"] < 4 * 2.0**-8).all() and not result.culprits
    no_replay = compare_dumps(toy_dumps["a"], toy_dumps["noisy"], replay=False)
    assert no_replay.noise_model == "intrinsic" and no_replay.rows["local_error_a"].isna().all()


@pytest.fixture(scope="module")
def update_dumps(tmp_path_factory):
    """fp32 runs of AdamW: as it is, on a kernel that computes with eps 1e-4 while its settings, and
    the records, say 1e-8, on one whose learning rate is 1.1 × theirs; and one whose step 1 batch has
    a sample changed."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("updates")
    runs = {"a": ToyRun(), "again": ToyRun(), "kernel": ToyRun(device=Emulation(adam_eps=1e-4)),
            "lr": ToyRun(device=Emulation(adam_lr_scale=1.1)), "batch": ToyRun(changed_sample_at=1)}
    return {name: dump_toy(root / name, run) for name, run in runs.items()}


UPDATE = "blocks.0.0.weight/Optimizer.step#0"


@pytest.mark.slow  # three toy trainings dumped in full, each replayed
def test_an_update_replayed_names_the_side_whose_optimizer_is_wrong(update_dumps):
    """AdamW recomputed in float64 from each side's recorded parameter, gradient, states and
    hyper-parameters: an unchanged pair within float64 rounding of their records on both sides; a
    kernel with another eps or learning rate is B, far off."""
    same = run_cli("replay", update_dumps["a"], UPDATE, "--against", update_dumps["again"], "--step", "1")
    assert same.returncode == 0 and "both within noise of each other" in same.stdout, same.stdout + same.stderr
    assert all(error < 1e-6 for error in _errors(same.stdout))
    for kernel in ("kernel", "lr"):  # another eps, another learning rate, than the settings say
        wrong = run_cli("replay", update_dumps["a"], UPDATE, "--against", update_dumps[kernel])
        assert wrong.returncode == 1 and "B is wrong" in wrong.stdout, wrong.stdout + wrong.stderr
        error_a, error_b = _errors(wrong.stdout)[:2]
        assert error_a < 1e-6 and error_b > 1e-4, kernel
    misused = run_cli("replay", update_dumps["a"], UPDATE, "--direction", "backward")
    assert_one_line_error(misused, "--direction is for API calls", "an optimizer update")


@pytest.mark.slow  # the dumps of the test above
def test_a_batch_is_not_replayed_its_bits_are_compared(update_dumps):
    same = run_cli("replay", update_dumps["a"], "input/Data#0", "--against", update_dumps["batch"], "--step", "0")
    assert same.returncode == 0 and "is not replayed" in same.stdout and "the same batch" in same.stdout
    differ = run_cli("replay", update_dumps["a"], "input/Data#0", "--against", update_dumps["batch"], "--step", "1")
    assert differ.returncode == 1 and "the batches differ" in differ.stdout, differ.stdout
