"""The monitor of every `pi0align run` (real PI0 tiny runs): monitor.h5 at every step, two runs'
module trends (`curves --modules`), alerts while a run goes on, a killed or damaged monitor; and
their checkpoints compared (`ckpt-diff`).
Faults are pushed into a run's process as bisect's tests push them (testing/device_site), from
some Adam step on."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from conftest import REPO, assert_one_line_error, offline_page, run_cli

from pi0align.compare.reading.open_dump import dumped_steps
from pi0align.compare.reading.read_monitor import read_monitor
from pi0align.dump.monitoring.monitor_file import QUANTITIES
from pi0align.errors import UserError
from pi0align.runs.monitor import BAND, compare_modules, load_monitor

TINY = ("--preset", "tiny", "--batch-size", "4", "--no-progress", "--log-every", "0")
SITE = str(REPO / "pi0align" / "testing" / "device_site")
EXPERT_1 = "model.paligemma_with_expert.gemma_expert.model.layers.1"
LANGUAGE_0 = "model.paligemma_with_expert.paligemma.model.language_model.layers.0"
VISION_0 = "model.paligemma_with_expert.paligemma.model.vision_tower.vision_model.encoder.layers.0"


def device(spec: dict) -> dict:
    """The environment that pushes an emulated device into every Python process started with it."""
    return {"PYTHONPATH": os.pathsep.join(filter(None, (SITE, os.environ.get("PYTHONPATH")))),
            "PI0ALIGN_EMULATED_DEVICE": json.dumps(spec)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """20 steps on 1 thread (a checkpoint at 10 and 20), again, on 2 threads, without the monitor,
    and with one action-expert gelu 3 % off from the 12th update on; 10 steps with the expert's
    layer 1 or the language model's layer 0 NaN from the 7th update on (--dump-on-alert); 10 steps
    of another seed; one step, and one step with another Adam ε."""
    root = tmp_path_factory.mktemp("monitor")
    steps = (*TINY, "--steps", "20")
    nan = lambda module: {"module": f"{module}.mlp", "function": "gelu", "factor": math.nan, "from_update": 7}  # noqa: E731
    commands = {
        "a": ((*steps, "--threads", "1", "--save-every", "10"), None),
        "same": ((*steps, "--threads", "1"), None),
        "threads": ((*steps, "--threads", "2"), None),
        "off": ((*steps, "--threads", "1", "--no-monitor"), None),
        "gelu": ((*steps, "--threads", "1"), device({"module": f"{EXPERT_1}.mlp", "function": "gelu",
                                                     "factor": 1.03, "from_update": 12})),
        "nan": ((*TINY, "--steps", "10", "--threads", "1", "--dump-on-alert"), device(nan(EXPERT_1))),
        "nan_language": ((*TINY, "--steps", "9", "--threads", "1"), device(nan(LANGUAGE_0))),
        "seed": ((*TINY, "--steps", "10", "--threads", "1", "--seed", "99"), None),
        "one": ((*TINY, "--steps", "1", "--threads", "1"), None),
        "eps": ((*TINY, "--steps", "1", "--threads", "1", "--adam-eps", "1e-6"), None),
    }
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        done = dict(zip(commands, pool.map(
            lambda name: run_cli("run", *commands[name][0], "--out", root / name, env=commands[name][1]), commands)))
    for name, result in done.items():
        assert result.returncode == 0, f"{name}: {result.stderr[-3000:]}"
    return {name: (root / name, result) for name, result in done.items()}


def losses(run) -> list[tuple[float, float]]:
    records = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
    return [(r["loss"], r["grad_norm"]) for r in records]


def test_a_run_monitors_every_block_at_every_step(runs):
    run = runs["a"][0]
    monitored = read_monitor(run / "monitor.h5")
    assert monitored.steps.tolist() == list(range(20)) and monitored.quantities == QUANTITIES
    modules = monitored.modules
    layers = {kind: sorted(int(m.rpartition(".")[2]) for m in modules if re.search(rf"{pattern}\.\d+$", m))
              for kind, pattern in (("vision", r"encoder\.layers"), ("language", r"language_model\.layers"),
                                    ("expert", r"gemma_expert\.model\.layers"))}
    assert all(found == list(range(len(found))) and found for found in layers.values()), layers
    assert {"model.action_in_proj", "model.action_out_proj", "model.state_proj"} <= set(modules)
    # the file lists the modules in the order they run: the vision tower first, the joint layers in turn
    assert modules.index(VISION_0) < modules.index(LANGUAGE_0) < modules.index(EXPERT_1)
    assert modules.index(f"{LANGUAGE_0[:-1]}1") > modules.index(f"{EXPERT_1[:-1]}0")
    values = {q: monitored.values[:, :, i] for i, q in enumerate(QUANTITIES)}
    for module in (VISION_0, LANGUAGE_0, EXPERT_1, "model.action_out_proj"):
        at = modules.index(module)
        for quantity in ("output_norm", "output_max", "grad_norm", "param_norm", "update_norm", "exp_avg_norm",
                         "exp_avg_sq_norm"):
            assert np.all(np.isfinite(values[quantity][:, at]) & (values[quantity][:, at] > 0)), (module, quantity)
        assert np.all(values["output_nonfinite"][:, at] == 0) and np.all(values["grad_nonfinite"][:, at] == 0)
    # Adam's first update moves each weight by the step's learning rate (m̂ / √v̂ = g / |g| = ±1), but
    # for a few weights whose gradient is 0 or within ε: 0.1 % less (the next step's rate, which the
    # scheduler has set when the step ends, is 0.6 % less)
    lr = json.loads((run / "train_log.jsonl").read_text().splitlines()[0])["lr"]
    expected = lr * math.sqrt(_elements(run, EXPERT_1))
    assert values["update_norm"][0, modules.index(EXPERT_1)] == pytest.approx(expected, rel=3e-3)


def _elements(run, module: str) -> int:
    from safetensors import safe_open

    with safe_open(str(run / "checkpoints" / "000010" / "pretrained_model" / "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys() if name.startswith(module + "."))


def test_the_monitor_changes_no_loss_and_no_run_without_it_has_one(runs):
    assert losses(runs["a"][0]) == losses(runs["off"][0])  # bit for bit, every step
    assert not list(runs["off"][0].glob("monitor*.h5"))


def test_two_runs_of_one_seed_leave_no_module_outside_the_band(runs):
    frame = load_monitor([runs["a"][0], runs["same"][0]])
    comparison = compare_modules(frame)
    assert comparison and comparison.differences["difference"].max() == 0  # bit for bit
    done = run_cli("curves", runs["a"][0], runs["same"][0], "--modules")
    assert done.returncode == 0 and "every module within ±0.001 of a" in done.stdout, done.stdout


def test_one_and_two_threads_stay_within_the_default_band(runs):
    comparison = compare_modules(load_monitor([runs["a"][0], runs["threads"][0]]))
    assert comparison, comparison.first_outside
    assert comparison.band == BAND


def test_a_gelu_off_from_step_12_is_the_first_module_to_leave_at_step_12(runs, tmp_path):
    report = tmp_path / "trends.json"
    done = run_cli("curves", runs["a"][0], runs["gelu"][0], "--modules", "--json", report, "--html",
                   tmp_path / "trends.html")
    assert done.returncode == 1, done.stderr
    written = json.loads(report.read_text())
    first = written["modules"]["first_outside"]["gelu"]
    assert first["module"] == EXPERT_1 and first["step"] == 12, first
    assert first["quantity"].startswith(("output_", "grad_")), first
    loss = next(r for r in written["runs"] if r["run"] == "gelu")
    assert loss["first_outside"] is None or loss["first_outside"] > 12  # the module first, the loss later if at all
    leaving = {(x["module"], x["quantity"]): x["first_outside"] for x in written["modules"]["leaving"]}
    assert all(step is None or step >= 12 for step in leaving.values())
    assert leaving[(EXPERT_1, "output_norm")] == 12
    console = " ".join(done.stdout.split())
    assert "where to look first" in console and "layers.1 " in console and "at step 12" in console, done.stdout


def test_the_heat_map_opens_in_chromium_and_overlays_a_row(runs, tmp_path, browser):
    page_file = tmp_path / "trends.html"
    done = run_cli("curves", runs["a"][0], runs["gelu"][0], "--modules", "--html", page_file)
    assert done.returncode == 1, done.stderr
    with offline_page(browser, page_file) as page:
        page.wait_for_selector("#heatmap-0 .main-svg")
        rows = page.evaluate("document.getElementById('heatmap-0')._fullData[0].y")
        z = page.evaluate("document.getElementById('heatmap-0')._fullData[0].z")
        assert EXPERT_1 in rows
        hottest = max(range(len(rows)), key=lambda i: max(v for v in z[i] if v is not None))
        assert rows[hottest] == EXPERT_1  # the row that leaves the band is the hottest
        assert EXPERT_1 in page.text_content("#modules-section .first-outside")
        page.evaluate(f"document.getElementById('heatmap-0').emit('plotly_click', {{points: [{{y: '{EXPERT_1}'}}]}})")
        page.wait_for_selector("#module-curves .main-svg")
        traces = page.evaluate("document.getElementById('module-curves')._fullData.map(t => t.name)")
        assert {"a output_norm", "gelu output_norm"} <= set(traces), traces


def test_a_nan_at_step_7_alerts_at_once_names_its_module_and_dumps_step_8(runs):
    run, result = runs["nan"]
    lines = [line for line in result.stderr.splitlines() if line.startswith("pi0align monitor: step")]
    assert lines[0].startswith(f"pi0align monitor: step 7: {EXPERT_1} output_norm is NaN"), lines
    alerts = [json.loads(line) for line in (run / "alerts.jsonl").read_text().splitlines()]
    assert alerts[0] == {"step": 7, "module": EXPERT_1, "quantity": "output_norm", "value": None, "rule": "nonfinite",
                         "mean": None}
    assert min(a["step"] for a in alerts) == 7
    # a NaN that stays alerts once: the rows of a step are the quantities that turned NaN there
    assert len({(a["module"], a["quantity"]) for a in alerts}) == len(alerts)
    assert (run / "alerts" / "000008" / "dump.h5").is_file()
    assert list(dumped_steps(run / "alerts" / "000008")[0]) == [8]
    # the step's NaN/Inf counted where the norm is not finite
    monitored = read_monitor(run / "monitor.h5")
    count = monitored.values[7, monitored.modules.index(EXPERT_1), QUANTITIES.index("output_nonfinite")]
    assert count > 0 and np.all(monitored.values[:7, :, QUANTITIES.index("output_nonfinite")][
        np.isfinite(monitored.values[:7, :, 0])] == 0)
    # and the gradients', though zero_grad dropped them before the row was made
    grads = monitored.values[7, :, QUANTITIES.index("grad_norm")]
    counts = monitored.values[7, :, QUANTITIES.index("grad_nonfinite")]
    nan = np.isnan(grads) & np.isfinite(counts)  # NaN gradients (a count is NaN where there are none)
    assert nan[monitored.modules.index(EXPERT_1)] and np.all(counts[nan] > 0)


def test_a_nan_in_another_module_is_named_there(runs):
    run, result = runs["nan_language"]
    first = next(line for line in result.stderr.splitlines() if line.startswith("pi0align monitor: step"))
    assert first.startswith(f"pi0align monitor: step 7: {LANGUAGE_0} output_norm"), first
    assert not (run / "alerts").exists()  # no --dump-on-alert


def test_a_killed_run_keeps_every_finished_step_and_a_damaged_monitor_is_one_line(tmp_path):
    run = tmp_path / "killed"
    child = subprocess.Popen([sys.executable, "-m", "pi0align.cli.main", "run", *TINY, "--threads", "1", "--steps",
                              "500", "--log-every", "1", "--out", str(run)], cwd=REPO, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    try:
        logged = 0
        for line in child.stderr:  # the step lines
            logged += bool(re.search(r"\bstep \d+ loss", line))
            if logged == 4:
                break
        assert child.poll() is None, "the run ended before it could be killed"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    deadline = time.monotonic() + 60  # the writer process finishes the rows handed to it
    while time.monotonic() < deadline:
        try:
            steps = read_monitor(run / "monitor.h5").steps.tolist()
        except UserError:
            steps = []
        if len(steps) >= 4:
            break
        time.sleep(0.2)
    assert steps == list(range(len(steps))) and len(steps) >= 4
    assert len(steps) >= len((run / "train_log.jsonl").read_text().splitlines())

    damaged = tmp_path / "damaged"
    shutil.copytree(run, damaged, ignore=shutil.ignore_patterns("checkpoints"))
    data = (run / "monitor.h5").read_bytes()
    (damaged / "monitor.h5").write_bytes(data[: len(data) // 2])
    assert_one_line_error(run_cli("curves", run, damaged, "--modules"), "monitor.h5")
    (damaged / "monitor.h5").write_bytes(b"\0" * 4096)
    assert_one_line_error(run_cli("curves", run, damaged, "--modules"), "monitor.h5")
    (damaged / "monitor.h5").unlink()
    assert_one_line_error(run_cli("curves", run, damaged, "--modules"), "no monitor")


def checkpoint(runs, name: str, step: int):
    return runs[name][0] / "checkpoints" / f"{step:06d}"


def test_ckpt_diff_of_a_checkpoint_with_itself_is_identical(runs, tmp_path):
    report = tmp_path / "same.json"
    done = run_cli("ckpt-diff", checkpoint(runs, "a", 10), checkpoint(runs, "a", 10) / "pretrained_model",
                   "--optimizer", "--json", report)
    assert done.returncode == 0 and "identical" in done.stdout, done.stdout + done.stderr
    tensors = json.loads(report.read_text())["tensors"]
    assert tensors and all(t["relative_l2"] == 0 and t["cosine"] == pytest.approx(1) for t in tensors)
    assert any(t["name"].endswith(":exp_avg_sq") for t in tensors)  # the optimizer's states, by parameter name


def test_ckpt_diff_of_two_seeds_finds_every_parameter_apart(runs, tmp_path):
    """Every parameter differs, but those that start as a constant and get no gradient (PI0 reads the
    language model's keys and values only: its last layer's last norm and its final norm stay 1)."""
    from safetensors.torch import load_file

    report = tmp_path / "seeds.json"
    done = run_cli("ckpt-diff", checkpoint(runs, "a", 10), checkpoint(runs, "seed", 10), "--json", report)
    assert done.returncode == 1, done.stderr
    tensors = json.loads(report.read_text())["tensors"]
    weights = load_file(checkpoint(runs, "a", 10) / "pretrained_model" / "model.safetensors")
    same = {t["name"] for t in tensors if t["relative_l2"] == 0}
    assert same == {name for name, w in weights.items() if bool((w == w.flatten()[0]).all())}, same
    assert all(t["relative_l2"] > 0.1 for t in tensors if "norm" not in t["name"])  # norms' weights start at 0 or 1
    assert f"{len(tensors) - len(same)} of {len(tensors)} tensors differ" in " ".join(done.stdout.split())


def test_ckpt_diff_of_one_step_with_another_adam_eps_sorts_the_parameters_that_moved(runs, tmp_path):
    """The same step 0 with ε 1e-8 and 1e-6: the same gradients, so the same moments; the weights
    that moved, moved by other updates; those without a gradient not at all."""
    from safetensors.torch import load_file

    report = tmp_path / "eps.json"
    done = run_cli("ckpt-diff", checkpoint(runs, "one", 1), checkpoint(runs, "eps", 1), "--optimizer", "--json",
                   report)
    assert done.returncode == 1, done.stderr
    tensors = json.loads(report.read_text())["tensors"]
    weights = [load_file(checkpoint(runs, name, 1) / "pretrained_model" / "model.safetensors")
               for name in ("one", "eps")]
    moved = {name for name in weights[0] if not weights[0][name].equal(weights[1][name])}
    differing = {t["name"] for t in tensors if t["relative_l2"] > 0}
    assert differing == moved and 0 < len(moved) < len(weights[0])
    assert not any(":" in name for name in differing)  # every moment identical
    order = [t["relative_l2"] for t in tensors]
    assert order == sorted(order, reverse=True)  # the largest difference first
    modules = " ".join(done.stdout.split())
    assert "modules, the largest difference first" in modules


def test_tensorboard_holds_each_runs_log_and_monitor(runs, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = tmp_path / "board"
    done = run_cli("curves", runs["a"][0], runs["gelu"][0], "--tensorboard", board)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in board.iterdir()) == ["a", "gelu"]
    events = EventAccumulator(str(board / "gelu"), size_guidance={"scalars": 0})
    events.Reload()
    tags = events.Tags()["scalars"]
    assert {"train/loss", "train/grad_norm", f"{EXPERT_1}/output_norm", f"{EXPERT_1}/update_norm"} <= set(tags)
    monitored = read_monitor(runs["gelu"][0] / "monitor.h5")
    written = {e.step: e.value for e in events.Scalars(f"{EXPERT_1}/output_norm")}
    stored = monitored.values[:, monitored.modules.index(EXPERT_1), QUANTITIES.index("output_norm")]
    assert sorted(written) == list(range(20)) and [written[s] for s in range(20)] == pytest.approx(stored, rel=1e-6)
    logged = [loss for loss, _ in losses(runs["gelu"][0])]
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx(logged)


class _Runs:
    """A pickled object that would run a command when unpickled: a crafted checkpoint."""

    def __init__(self, marker) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_ckpt_diff_of_a_missing_damaged_or_crafted_checkpoint_is_one_line(runs, tmp_path):
    import torch

    good = checkpoint(runs, "a", 10)
    assert_one_line_error(run_cli("ckpt-diff", good, tmp_path / "missing"), "no model.safetensors")
    damaged = tmp_path / "damaged"
    shutil.copytree(good, damaged)
    weights = damaged / "pretrained_model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert_one_line_error(run_cli("ckpt-diff", good, damaged), "not readable as safetensors")
    crafted = tmp_path / "crafted"
    shutil.copytree(good, crafted)
    marker = tmp_path / "ran"
    torch.save({"optimizer": _Runs(marker)}, crafted / "training_state.pt")
    assert_one_line_error(run_cli("ckpt-diff", good, crafted, "--optimizer"), "never unpickled")
    assert not marker.exists()


def test_dump_on_alert_without_the_monitor_is_one_line(tmp_path):
    done = run_cli("run", *TINY, "--steps", "1", "--no-monitor", "--dump-on-alert", "--out", tmp_path / "run")
    assert_one_line_error(done, "--dump-on-alert", "--no-monitor")
    assert not (tmp_path / "run" / "train_log.jsonl").exists()
