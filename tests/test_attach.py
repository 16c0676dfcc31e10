"""`pi0align attach -- COMMAND`: the real, unmodified `lerobot-train` (ACT on the synthetic dataset:
PI0 cannot train under it offline), dumped, monitored and seeded without an edit, in one process
and under torchrun; faults are pushed into its processes by the test's own start-up hook
(testing/device_site), which attach's hands over to."""

from __future__ import annotations

import json
import math
import os
import sys

import numpy as np
import pytest
from conftest import REPO, assert_one_line_error, run_cli, run_clis

from pi0align.testing.lerobot_train import LEROBOT_TRAIN, lerobot_train

SITE = str(REPO / "pi0align" / "testing" / "device_site")
STEPS, LOG_FREQ = 4, 2
ENCODER_LINEAR = "model.encoder.layers.0.linear1"
DECODER_LINEAR = "model.decoder.layers.0.linear2"


def _fault(module: str, factor: float) -> dict:
    spec = {"module": module, "function": "linear", "factor": factor, "policy": "ACTPolicy"}
    return {"PYTHONPATH": os.pathsep.join(filter(None, (SITE, os.environ.get("PYTHONPATH")))),
            "PI0ALIGN_EMULATED_DEVICE": json.dumps(spec)}


def _attach(out, *flags, threads: int = 1, launcher: tuple = ()):
    command = lerobot_train(out.with_name(out.name + "-train"), steps=STEPS, log_freq=LOG_FREQ)
    if launcher:
        command = [*launcher, *command]
    return ("attach", "--out", out, "--threads", str(threads), *flags, "--", *command)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from concurrent.futures import ThreadPoolExecutor

    root = tmp_path_factory.mktemp("attach")
    dumped = ("--seed", "1234", "--dump-steps", "0,1")
    made = [(_attach(root / "A", *dumped), None), (_attach(root / "same", *dumped), None),
            (_attach(root / "threads", *dumped, threads=2), None), (_attach(root / "attached", "--no-monitor"), None),
            (_attach(root / "encoder", *dumped), _fault(ENCODER_LINEAR, 1.02)),
            (_attach(root / "decoder", *dumped, threads=2), _fault(DECODER_LINEAR, 1.002))]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        done = list(pool.map(lambda made: run_cli(*made[0], env=made[1]), made))
    for result in done:
        assert result.returncode == 0, result.stderr[-3000:]
    return root


def _compare(a, b, json_path):
    result = run_cli("compare", a, b, "--json", json_path, "--no-html")
    assert "Traceback" not in result.stderr, result.stderr
    return result.returncode, json.loads(json_path.read_text())


@pytest.mark.slow
def test_the_same_seed_twice_dumps_bit_identical(runs, tmp_path):
    for name in ("A", "same"):
        assert {p.name for p in (runs / name).iterdir()} >= {"dump.h5", "monitor.h5", "manifest.json",
                                                               "train_log.jsonl", "console.log"}
    from pi0align.compare import compare_dumps

    result = compare_dumps(runs / "A", runs / "same")
    assert result.verdict == "aligned" and not result.culprits
    errors = result.rows[["norm_rel_err", "max_val_rel_err", "min_rel_err", "mean_val_rel_err"]]
    assert len(result.rows) > 1000 and (errors == 0).all(axis=None)  # every statistic holds the same bits
    logs = [(runs / name / "train_log.jsonl").read_text() for name in ("A", "same")]
    assert [json.loads(line)["loss"] for line in logs[0].splitlines()] == \
        [json.loads(line)["loss"] for line in logs[1].splitlines()]
    manifest = json.loads((runs / "A" / "manifest.json").read_text())
    assert manifest["attached"]["seed_forced"] and manifest["attached"]["model"] == "ACTPolicy"
    assert manifest["policy_type"] == "act" and manifest["hyperparameters"]["optimizer_lr"] == 1e-5


@pytest.mark.slow
def test_another_thread_count_is_aligned_and_a_faulty_call_is_named(runs, tmp_path):
    code, threads = _compare(runs / "A", runs / "threads", tmp_path / "threads.json")
    assert (code, threads["verdict"], threads["culprits"]) == (0, "aligned", []), threads["notes"]
    for name, module, threads_run in (("encoder", ENCODER_LINEAR, "A"), ("decoder", DECODER_LINEAR, "threads")):
        code, faulty = _compare(runs / threads_run, runs / name, tmp_path / f"{name}.json")
        assert code == 1 and faulty["verdict"] == "diverged", faulty["notes"]
        assert faulty["culprits"][0]["name"] == f"{module}/Functional.linear#0", faulty["culprits"][:3]


@pytest.mark.slow
def test_losses_and_weights_are_those_of_the_script_without_attach(runs, tmp_path):
    """`attached` ran under attach (monitor on, no dump, its seed not forced); the same command
    without attach, on the same thread count, leaves the same log lines and the same weights."""
    import subprocess

    command = lerobot_train(tmp_path / "plain-train", steps=STEPS, log_freq=LOG_FREQ)
    plain = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                           timeout=600)
    assert plain.returncode == 0, plain.stderr[-3000:]

    def step_lines(text: str) -> list[str]:
        return [line.split("ot_train.py:435 ")[1].split(" updt_s")[0] for line in text.splitlines()
                if "ot_train.py:435 step:" in line]

    assert step_lines(plain.stdout + plain.stderr) == step_lines((runs / "attached" / "console.log").read_text())
    assert len(step_lines(plain.stdout + plain.stderr)) == STEPS // LOG_FREQ
    checkpoints = [folder / "checkpoints" / "last" / "pretrained_model"
                   for folder in (tmp_path / "plain-train", runs / "attached-train")]
    same = run_cli("ckpt-diff", *checkpoints)
    assert same.returncode == 0 and "identical" in same.stdout, same.stdout + same.stderr


@pytest.mark.slow
def test_under_launchers_each_rank_dumps_and_compares(tmp_path):
    """torchrun with two processes: a dump and a monitor per rank, compared rank by rank.
    `accelerate launch --cpu` starts one process here (its CPU processes need MPI): attached all the same."""
    launchers = os.path.dirname(sys.executable)
    torchrun = (os.path.join(launchers, "torchrun"), "--nproc_per_node", "2")
    accelerate = (os.path.join(launchers, "accelerate"), "launch", "--cpu", "--num_processes", "1",
                  "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no")
    done = run_clis(*(_attach(tmp_path / name, "--seed", "1234", "--dump-steps", "0", launcher=torchrun)
                      for name in ("A", "B")),
                    _attach(tmp_path / "accelerate", "--seed", "1234", "--dump-steps", "0", launcher=accelerate))
    for result in done:
        assert result.returncode == 0, result.stderr[-3000:]
    assert {p.name for p in (tmp_path / "accelerate").glob("*.h5")} == {"dump.h5", "monitor.h5"}
    for name in ("A", "B"):
        assert {p.name for p in (tmp_path / name).glob("*.h5")} == {"dump-rank0.h5", "dump-rank1.h5",
                                                                    "monitor-rank0.h5", "monitor-rank1.h5"}
    code, compared = _compare(tmp_path / "A", tmp_path / "B", tmp_path / "ranks.json")
    assert code == 0 and compared["verdict"] == "aligned", compared["notes"]
    assert sorted(compared["rank_verdicts"]) == ["0", "1"], compared["rank_verdicts"]


def test_a_script_without_an_optimizer_is_one_line(tmp_path):
    script = tmp_path / "no_optimizer.py"
    script.write_text("import torch\nprint(torch.nn.Linear(2, 2)(torch.ones(2)).sum().item())\n")
    assert_one_line_error(run_cli("attach", "--out", tmp_path / "out", "--", sys.executable, script),
                          "built no torch optimizer")
    assert_one_line_error(run_cli("attach", "--out", tmp_path / "out", "--", "no-such-trainer"), "no-such-trainer")
    assert_one_line_error(run_cli("attach", "--out", tmp_path / "out"), "no command")
    bad_attr = run_cli("attach", "--model-attr", "nothing.here", "--out", tmp_path / "out", "--", sys.executable,
                       "-c", "import torch; net = torch.nn.Linear(2, 2); torch.optim.SGD(net.parameters(), lr=0.1)")
    assert bad_attr.returncode == 2 and "Traceback" not in bad_attr.stderr, bad_attr.stderr
    assert [line for line in bad_attr.stderr.splitlines() if line.strip()] == [
        "pi0align attach: --model-attr nothing.here: no module at nothing.here of the Linear the first optimizer "
        "trains, nor among the script's globals"]
    assert LEROBOT_TRAIN.endswith("lerobot-train")


def test_a_loop_of_ones_own_is_attached_with_its_losses_unchanged(tmp_path):
    """A plain PyTorch loop (no LeRobot): the same losses, bit for bit, with attach (dumping a step
    and monitoring every one) and without; the model found through its optimizer, its loss from
    the output's `loss` key, its gradient norm where it clips; the monitor's gradient norms those
    the L2 clip computed (torch's, to the bit) before it scaled the gradients, and its own before
    a clip attach leaves to torch (an ∞-norm one)."""
    script = tmp_path / "train.py"
    script.write_text(
        "import json, torch\n"
        "torch.manual_seed(0)\n"
        "class Net(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.body = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.GELU(), torch.nn.Linear(300, 1))\n"
        "    def forward(self, x):\n"
        "        return {'loss': self.body(x).square().mean()}\n"
        "net = Net()\n"
        "optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)\n"
        "for step in range(6):\n"
        "    loss = net(torch.randn(32, 64))['loss']\n"
        "    loss.backward()\n"
        "    norms = [torch.linalg.vector_norm(p.grad).item() for p in net.parameters()]\n"
        "    if step % 2:  # a clip attach leaves to torch: the monitor reads the gradients itself\n"
        "        torch.nn.utils.clip_grad_norm_(net.parameters(), 1e-3, norm_type=float('inf'))\n"
        "    else:\n"
        "        torch.nn.utils.clip_grad_norm_(net.parameters(), 1e-3)\n"
        "    optimizer.step()\n"
        "    optimizer.zero_grad()\n"
        "    print(json.dumps({'loss': repr(loss.item()), 'gradient_norms': norms}))\n")
    import subprocess

    plain = subprocess.run([sys.executable, script], capture_output=True, text=True, check=True,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    attached = run_cli("attach", "--out", tmp_path / "out", "--threads", "1", "--dump-steps", "2", "--",
                       sys.executable, script)
    assert attached.returncode == 0, attached.stderr
    assert attached.stdout == plain.stdout
    printed = [json.loads(line) for line in plain.stdout.splitlines()]
    logged = [json.loads(line) for line in (tmp_path / "out" / "train_log.jsonl").read_text().splitlines()]
    assert [repr(r["loss"]) for r in logged] == [p["loss"] for p in printed]
    assert [r["step"] for r in logged] == list(range(6)) and all(r["grad_norm"] > 0 for r in logged)
    from pi0align.compare.reading.open_dump import dumped_steps
    from pi0align.runs.monitor import load_monitor

    assert list(dumped_steps(tmp_path / "out")[0]) == [2]
    from pi0align.compare import compare_dumps

    metrics = compare_dumps(tmp_path / "out", tmp_path / "out").metrics_a  # every step's, past the dumped one
    assert metrics["step"].tolist() == list(range(6)) and [repr(x) for x in metrics["loss"]] == [
        p["loss"] for p in printed]
    monitor = load_monitor([tmp_path / "out"])
    assert sorted(monitor["step"].unique()) == list(range(6))
    grad_norm = monitor[monitor["quantity"] == "grad_norm"].pivot(index="step", columns="module", values="value")
    # each Linear's: √(‖weight's gradient‖² + ‖bias's‖²), over the norms the script's L2 clip
    # computed (even steps: to the bit), or the monitor's own (odd steps: the ∞-norm clip's are not)
    expected = np.array([[math.sqrt(w * w + b * b) for w, b in (p["gradient_norms"][:2], p["gradient_norms"][2:])]
                         for p in printed], np.float32)
    recorded = grad_norm[["body.0", "body.2"]].to_numpy(np.float32)
    assert recorded[::2].tolist() == expected[::2].tolist()
    np.testing.assert_allclose(recorded[1::2], expected[1::2], rtol=1e-5)


def test_a_model_whose_output_holds_no_loss_is_read_from_the_scripts_own_log(tmp_path):
    """The loss computed by the loop, outside the model: no loss in attach's log; `curves` reads the
    script's own (pi0align's recipe-log lines here), which attach kept as console.log."""
    script = tmp_path / "train.py"
    script.write_text(
        "import torch\n"
        "torch.manual_seed(0)\n"
        "net = torch.nn.Linear(4, 1)\n"
        "optimizer = torch.optim.SGD(net.parameters(), lr=0.1)\n"
        "for step in range(4):\n"
        "    loss = net(torch.randn(8, 4)).square().mean()\n"
        "    loss.backward()\n"
        "    optimizer.step()\n"
        "    optimizer.zero_grad()\n"
        "    print(f'step {step} loss {loss.item():.6f} grad_norm 0.0000 lr 1.00e-01', flush=True)\n")
    attached = run_cli("attach", "--out", tmp_path / "out", "--threads", "1", "--", sys.executable, script)
    assert attached.returncode == 0, attached.stderr
    assert not (tmp_path / "out" / "train_log.jsonl").exists()
    from pi0align.curves import load_runs

    frame = load_runs([tmp_path / "out"])
    printed = [float(line.split()[3]) for line in attached.stdout.splitlines() if line.startswith("step ")]
    assert frame["step"].tolist() == [0, 1, 2, 3] and frame["loss"].tolist() == printed
