"""`curves`, `check` and `env-diff` on the logs runs already leave: the real, unmodified
`lerobot-train` (its console log, kept by `pi0align attach`, and its train_config.json), TensorBoard
event files and CSV, beside pi0align's own run folders."""

from __future__ import annotations

import json

import pytest
from conftest import assert_one_line_error, pi0align, run_cli, run_clis

from pi0align.testing.lerobot_train import lerobot_train

STEPS, LOG_FREQ = 20, 5
TINY = ("--preset", "tiny", "--batch-size", "4", "--threads", "1", "--no-progress", "--log-every", "0")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """lerobot-train (ACT, 20 steps, logged every 5) under attach: its console log and the per-step
    log attach keeps; the same with another learning rate; and a pi0align run of PI0 tiny."""
    root = tmp_path_factory.mktemp("logs")
    done = run_clis(
        ("attach", "--out", root / "A", "--threads", "1", "--",
         *lerobot_train(root / "A-train", steps=STEPS, log_freq=LOG_FREQ)),
        ("attach", "--out", root / "lr", "--threads", "1", "--",
         *lerobot_train(root / "lr-train", steps=STEPS, log_freq=LOG_FREQ, extra=("--policy.optimizer_lr=1e-3",))),
        ("run", *TINY, "--steps", "2", "--out", root / "pi0"))
    for result in done:
        assert result.returncode == 0, result.stderr[-3000:]
    return root


def _curves(*args):
    result = run_cli("curves", *args)
    assert "Traceback" not in result.stderr, result.stderr
    return result


def test_a_lerobot_log_is_compared_with_a_per_step_run_over_its_windows(runs, tmp_path):
    log = runs / "A" / "console.log"
    kept = [json.loads(line) for line in (runs / "A" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in kept] == list(range(STEPS))
    same = _curves(log, runs / "A", "--json", tmp_path / "same.json")
    assert same.returncode == 0, same.stdout
    assert "windows of 5 steps" in same.stdout and "±0.0005" in same.stdout, same.stdout
    compared = json.loads((tmp_path / "same.json").read_text())["runs"][0]
    assert (compared["window"], compared["steps"], compared["first_outside"]) == (LOG_FREQ, STEPS // LOG_FREQ, None)
    # the log's means are the per-step losses' means over its windows, to its 3 decimals
    assert compared["max_relative_error"] < 1e-3 and compared["resolution"] == 5e-4

    parted = _curves(log, runs / "lr", "--json", tmp_path / "lr.json")
    assert parted.returncode == 1, parted.stdout
    outside = json.loads((tmp_path / "lr.json").read_text())["runs"][0]
    assert outside["window"] == LOG_FREQ and outside["first_outside"] in range(LOG_FREQ - 1, STEPS, LOG_FREQ)
    first = outside["first_outside"]
    assert f"{first - LOG_FREQ + 1}–{first}" in parted.stdout, parted.stdout
    # the same with the per-step run first: its windows are the log's all the same
    assert _curves(runs / "lr", log, "--json", tmp_path / "reversed.json").returncode == 1
    assert json.loads((tmp_path / "reversed.json").read_text())["runs"][0]["first_outside"] == first


def test_tensorboard_events_and_csv_read_as_the_run_they_hold(runs, tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    kept = [json.loads(line) for line in (runs / "lr" / "train_log.jsonl").read_text().splitlines()]
    with SummaryWriter(log_dir=str(tmp_path / "tb")) as writer:
        for record in kept:
            writer.add_scalar("train/loss", record["loss"], record["step"])
            writer.add_scalar("train/grad_norm", record["grad_norm"], record["step"])
    (tmp_path / "losses.csv").write_text("epoch,iteration,train_loss\n"
                                         + "".join(f"0,{r['step']},{r['loss']!r}\n" for r in kept))
    (tmp_path / "metrics.jsonl").write_text("".join(
        json.dumps({"global_step": r["step"], "train_loss": r["loss"]}) + "\n"
        + json.dumps({"global_step": r["step"], "eval_accuracy": 0.5}) + "\n" for r in kept))
    log = runs / "A" / "console.log"
    results = {}
    for name, source, flags in (("folder", runs / "lr", ()), ("tb", tmp_path / "tb", ()),
                                ("csv", tmp_path / "losses.csv", ("--columns", "iteration,train_loss")),
                                ("jsonl", tmp_path / "metrics.jsonl", ())):
        result = _curves(log, source, *flags, "--json", tmp_path / f"{name}.json")
        assert result.returncode == 1, result.stdout + result.stderr
        results[name] = json.loads((tmp_path / f"{name}.json").read_text())["runs"][0]
    # TensorBoard keeps float32: the errors agree to its rounding, the first window outside exactly
    for name in ("tb", "csv", "jsonl"):
        assert results[name]["first_outside"] == results["folder"]["first_outside"]
        assert results[name]["mean_relative_error"] == pytest.approx(results["folder"]["mean_relative_error"],
                                                                     rel=1e-6)
    # a tag that is not there, columns that are not there: one line each
    assert_one_line_error(run_cli("curves", log, tmp_path / "tb", "--loss-tag", "eval/loss"), "eval/loss",
                          "train/grad_norm")
    assert_one_line_error(run_cli("curves", log, tmp_path / "losses.csv", "--columns", "step,loss"),
                          "losses.csv")


def test_a_log_without_step_lines_is_one_line(runs, tmp_path):
    summary_only = tmp_path / "Pi0_bs12_8p_acc.log"
    summary_only.write_text("Final Performance images/sec: 12.50\nFinal Train Loss: 0.512000\n"
                            "E2E Training Duration sec: 100.00\n")
    assert_one_line_error(run_cli("curves", runs / "A", summary_only), "Pi0_bs12_8p_acc.log",
                          "not a run folder of `pi0align run` nor a log")
    only_config = tmp_path / "header.log"
    lines = (runs / "A" / "console.log").read_text().splitlines()
    only_config.write_text("\n".join(line for line in lines if "step:" not in line) + "\n")
    assert_one_line_error(run_cli("curves", runs / "A", only_config), "header.log")


def test_lerobot_step_counts_in_thousands_are_made_exact(tmp_path):
    """Lines made by LeRobot's own tracker (its `format_big_number`: 1K for 1,000 to 1,499), logged
    every 200 steps to 20,000, with and without the printed config that says log_freq."""
    from lerobot.utils.logging_utils import AverageMeter, MetricsTracker

    tracker = MetricsTracker(8, 1000, 10, {"loss": AverageMeter("loss", ":.3f"),
                                           "grad_norm": AverageMeter("grdn", ":.3f")})
    lines, expected = [], {}
    for step in range(20000):
        tracker.loss, tracker.grad_norm = 1.0 / (1 + step / 1000), 2.0
        tracker.step()
        if (step + 1) % 200 == 0:
            lines.append(f"INFO 2026-12-07 01:00:00 ot_train.py:435 {tracker}")
            expected[step] = float(str(tracker).split("loss:")[1].split()[0])
            tracker.reset_averages()
    assert any("step:2K" in line for line in lines) and any("step:20K" in line for line in lines)
    log = tmp_path / "train.log"
    log.write_text("\n".join(lines) + "\n")
    from pi0align.runs.folder import read_run

    run = read_run(log, need_log=True)
    assert run.kind == "lerobot-train console log"
    assert {r["step"]: r["loss"] for r in run.log} == expected
    assert {r["window"] for r in run.log} == {200}
    # from step 1,000 on only (a log cut at its start, no config printed): its steps cannot be told
    cut = tmp_path / "cut.log"
    cut.write_text("\n".join(lines[5:]) + "\n")
    assert_one_line_error(run_cli("curves", cut, log), "cut.log", "log_freq")
    # with the config LeRobot prints first, they can
    config = "INFO 2026-12-07 01:00:00 ot_train.py:197 {'batch_size': 8,\n 'dataset': {'repo_id': 'x'},\n" \
             " 'log_freq': 200,\n 'optimizer': {'lr': 2.5e-05},\n 'policy': {'type': 'pi0'}}\n"
    cut.write_text(config + "\n".join(lines[5:]) + "\n")
    assert [r["step"] for r in read_run(cut, need_log=True).log] == sorted(expected)[5:]


def test_check_holds_a_run_to_a_baseline_recorded_from_a_lerobot_log(runs, tmp_path):
    baselines = tmp_path / "baselines"
    code, stderr = pi0align("check", runs / "A" / "console.log", "--save-baseline", "gpu-log",
                            "--baselines", baselines)
    assert code == 0, stderr
    recorded = [json.loads(line) for line in (baselines / "gpu-log" / "train_log.jsonl").read_text().splitlines()]
    assert [r["window"] for r in recorded] == [LOG_FREQ] * (STEPS // LOG_FREQ)
    # the case study's log: LeRobot's lines, then its scripts' three summary lines
    case_study = tmp_path / "train_act_1p_base_fp32.log"
    case_study.write_text((runs / "A" / "console.log").read_text() + "Final Performance images/sec: 41.20\n"
                          "Final Train Loss: 0.749\nE2E Training Duration sec: 30.50\n")
    code, stderr = pi0align("check", case_study, "--save-baseline", "case-study", "--baselines", baselines)
    assert code == 0, stderr
    summary = json.loads((baselines / "case-study" / "summary.json").read_text())
    assert summary == {"images_per_sec": 41.2, "final_loss": 0.749, "e2e_seconds": 30.5}
    passed = run_cli("check", runs / "A", "--baseline", "gpu-log", "--baselines", baselines, env={"COLUMNS": "200"})
    assert passed.returncode == 0, passed.stdout + passed.stderr
    assert "4 windows" in passed.stdout and "windows of 5 steps" in passed.stdout
    assert f"means of steps {STEPS - LOG_FREQ}–{STEPS - 1}" in passed.stdout
    failed = run_cli("check", runs / "lr", "--baseline", "gpu-log", "--baselines", baselines, env={"COLUMNS": "200"})
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert "learning rate" in failed.stdout  # the set-up line: the baseline's log printed its config


def test_env_diff_reads_a_lerobot_checkpoints_training_config(runs):
    config = runs / "A-train" / "checkpoints" / "last" / "pretrained_model" / "train_config.json"
    assert config.is_file()
    result = run_cli("env-diff", config, runs / "pi0", "--json", runs / "envdiff.json")
    assert result.returncode == 1, result.stdout + result.stderr
    lines = {line["item"]: line for line in json.loads((runs / "envdiff.json").read_text())}
    for item in ("learning rate", "optimizer betas", "optimizer weight decay", "optimizer grad clip norm",
                 "steps"):
        assert lines[item]["status"] == "differs and matters", (item, lines[item])
    assert lines["Adam's epsilon"]["status"] == "same"
    assert lines["seed"]["a"] == 1234 and lines["policy"]["a"] == "act"
    # the output folder and the checkpoint folder lead to the same config
    for folder in (runs / "A-train", config.parent.parent):
        again = run_cli("env-diff", folder, runs / "pi0", "--json", runs / "again.json")
        assert json.loads((runs / "again.json").read_text()) == json.loads((runs / "envdiff.json").read_text())
        assert again.returncode == 1
