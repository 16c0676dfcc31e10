"""`pi0align run` end to end: real LeRobot PI0 (tiny preset), real dataset, real checkpoints."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, assert_one_line_error, run_cli, run_clis

TINY = ("--preset", "tiny", "--batch-size", "4", "--threads", "2", "--no-progress", "--log-every", "0")
SUMMARY_KEYS = {"steps", "final_loss", "final_grad_norm", "images_per_sec", "mean_step_time_s", "e2e_seconds", "out",
                "device", "seed", "seed_impl", "parameter_count"}
MANIFEST_KEYS = {"device", "device_name", "device_count", "dtype", "seed", "seed_impl", "world_size", "rank",
                 "versions", "config", "hyperparameters", "weights_sha256", "dataset_fingerprint", "git_commit",
                 "transformers_compat"}


def read_log(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> list[tuple[float, float]]:
    return [(record["loss"], record["grad_norm"]) for record in read_log(run_dir)]


@pytest.fixture(scope="module")
def seeded_runs(tmp_path_factory):
    """Two runs with seed 1234 (4 steps, checkpoint every 2) and one with seed 99."""
    base = tmp_path_factory.mktemp("runs")
    names = {"first": 1234, "second": 1234, "other_seed": 99}
    done = run_clis(*(("run", *TINY, "--steps", "4", "--save-every", "2", "--seed", seed, "--out", base / name)
                      for name, seed in names.items()))
    for result in done:
        assert result.returncode == 0, result.stderr
    return {name: (base / name, result) for name, result in zip(names, done)}


def test_same_seed_gives_bit_identical_losses_and_grad_norms(seeded_runs):
    first, second = losses(seeded_runs["first"][0]), losses(seeded_runs["second"][0])
    assert len(first) == 4
    assert first == second  # exact float equality, every step


def test_another_seed_gives_different_losses(seeded_runs):
    first, other = losses(seeded_runs["first"][0]), losses(seeded_runs["other_seed"][0])
    assert all(a != b for a, b in zip(first, other))
    manifests = [json.loads((seeded_runs[name][0] / "manifest.json").read_text()) for name in ("first", "other_seed")]
    assert manifests[0]["weights_sha256"] != manifests[1]["weights_sha256"]


def test_summary_lines_and_files_are_complete(seeded_runs):
    run_dir, result = seeded_runs["first"]
    lines = result.stdout.splitlines()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert f"Final Performance images/sec: {summary['images_per_sec']:.2f}" in lines
    assert f"Final Train Loss: {summary['final_loss']:.6f}" in lines
    assert f"E2E Training Duration sec: {summary['e2e_seconds']:.2f}" in lines
    assert SUMMARY_KEYS <= summary.keys()
    assert summary["final_loss"] == read_log(run_dir)[-1]["loss"]
    assert summary["images_per_sec"] > 0 and summary["steps"] == 4

    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert MANIFEST_KEYS <= manifest.keys()
    assert set(manifest["versions"]) >= {"python", "torch", "torch_npu", "cann", "transformers", "lerobot", "deepspeed",
                                         "accelerate", "msprobe"}
    assert manifest["versions"]["lerobot"] == "0.4.4"
    assert manifest["seed"] == 1234 and manifest["config"]["preset"] == "tiny"
    assert manifest["transformers_compat"] in {"pi0align-compat", "patched-build"}
    assert len(manifest["weights_sha256"]) == 64 and len(manifest["dataset_fingerprint"]) == 64
    assert manifest["hyperparameters"]["optimizer_grad_clip_norm"] == 1.0

    record = read_log(run_dir)[0]
    assert {"step", "loss", "grad_norm", "lr", "step_time_s", "samples_per_s"} <= record.keys()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["000002", "000004"]
    assert (run_dir / "checkpoints" / "000004" / "pretrained_model" / "model.safetensors").is_file()


@pytest.mark.slow  # a run killed, then resumed: two processes that import torch and LeRobot
def test_run_killed_after_a_checkpoint_resumes_to_the_same_losses(seeded_runs, tmp_path):
    """SIGKILL once checkpoint 2 exists, resume from it: every step equals the uninterrupted run."""
    run_dir = tmp_path / "killed"
    process = subprocess.Popen(
        [sys.executable, "-m", "pi0align.cli.main", "run", *TINY, "--steps", "4", "--save-every", "2",
         "--seed", "1234", "--out", str(run_dir)],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    checkpoint = run_dir / "checkpoints" / "000002"
    deadline = time.monotonic() + 300
    while not checkpoint.is_dir() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert checkpoint.is_dir()

    result = run_cli("run", "--resume", checkpoint, "--no-progress")
    assert result.returncode == 0, result.stderr
    assert losses(run_dir) == losses(seeded_runs["first"][0])
    assert [record["step"] for record in read_log(run_dir)] == [0, 1, 2, 3]


def test_make_dataset_output_loads_with_lerobot_offline(tmp_path):
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    root = tmp_path / "koch_like"
    result = run_cli("make-dataset", root, "--episodes", "3", "--frames", "12")
    assert result.returncode == 0, result.stderr
    dataset = LeRobotDataset("pi0align/synthetic_koch", root=root)
    assert len(dataset) == 36 and dataset.meta.total_episodes == 3 and dataset.fps == 30
    frame = dataset[0]
    assert frame["observation.state"].shape == (6,) and frame["action"].shape == (6,)
    assert frame["observation.images.laptop"].shape == (3, 48, 64)
    assert frame["observation.images.phone"].shape == (3, 48, 64)
    assert frame["task"] == "Grasp a lego block and put it in the bin."
    assert dataset.meta.features["action"]["names"][0] == "shoulder_pan"


# each a process that imports torch and LeRobot (about 10 s): the missing files in CI only
_SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (("--device", "npu"), ("torch_npu",)),
        (("--device", "tpu"), ("unknown device", "tpu")),
        pytest.param(("--dataset", "/nonexistent/koch"), ("does not exist", "--dataset"), marks=_SLOW),
        pytest.param(("--tokenizer", "/nonexistent/paligemma"), ("/nonexistent/paligemma", "--tokenizer"), marks=_SLOW),
        pytest.param(("--pretrained", "/nonexistent/pi0"), ("model.safetensors", "--pretrained"), marks=_SLOW),
        pytest.param(("--preset", "full"), ("--tokenizer",), marks=_SLOW),
    ],
)
def test_bad_input_ends_with_one_line(args, fragments, tmp_path):
    result = run_cli("run", *TINY, "--steps", "1", "--out", tmp_path / "run", *args)
    assert_one_line_error(result, *fragments)


def test_the_config_checks_itself_from_python_and_from_the_command_line():
    from pi0align.errors import UserError
    from pi0align.train.config import TrainConfig

    for fields, message in (({"steps": 0}, "--steps must be at least 1"), ({"log_every": -1}, "--log-every"),
                            ({"dtype": "fp16"}, "--dtype must be one of fp32, bf16")):
        with pytest.raises(UserError, match=message):
            TrainConfig(**fields)
    assert_one_line_error(run_cli("run", *TINY, "--batch-size", "0"), "--batch-size must be at least 1")


def test_every_config_field_is_a_run_flag_that_reaches_the_config():
    import argparse
    import dataclasses
    from pathlib import Path

    from pi0align.cli.run import add_arguments, start_from_args
    from pi0align.train.config import TrainConfig

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert {f.name for f in dataclasses.fields(TrainConfig)} <= {action.dest for action in parser._actions}
    given = ["--batch-size", "3", "--no-deterministic", "--dataset", "/data/koch", "--lr", "0.5", "--preset", "tiny",
             "--keep-dropout", "--dump-backend", "torch"]
    start = start_from_args(parser.parse_args(given))
    assert start.resume_from is None and start.started_from is None
    assert start.config == TrainConfig(batch_size=3, deterministic=False, dataset=Path("/data/koch"), lr=0.5,
                                       preset="tiny", rm_dropout=False)
    assert start_from_args(parser.parse_args([])).config == TrainConfig()
    assert_one_line_error(run_cli("run", *TINY, "--dump-steps", "0", "--dump-backend", "gpu"), "--dump-backend")


def test_dump_steps_take_the_steps_grammar_of_every_command():
    from pi0align.cli.steps import parse_steps

    assert parse_steps("0, 3,5-7") == [0, 3, 5, 6, 7] and parse_steps("2-2") == [2]
    for bad in ("x", "7-5", "-1"):
        assert_one_line_error(run_cli("run", *TINY, "--dump-steps", bad), "--dump-steps", repr(bad))


@_SLOW
def test_corrupt_dataset_ends_with_one_line(tmp_path):
    root = tmp_path / "corrupt"
    (root / "meta").mkdir(parents=True)
    (root / "meta" / "info.json").write_text("{not json")
    assert_one_line_error(run_cli("run", *TINY, "--steps", "1", "--dataset", root), "corrupt", "info.json")


@_SLOW
def test_dataset_without_data_files_ends_with_one_line(tmp_path):
    root = tmp_path / "empty"
    run_cli("make-dataset", root, "--episodes", "1", "--frames", "8")
    for parquet in (root / "data").rglob("*.parquet"):
        parquet.write_bytes(b"garbage")
    assert_one_line_error(run_cli("run", *TINY, "--steps", "1", "--dataset", root), "cannot load the dataset")
