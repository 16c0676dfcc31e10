"""Several processes through torch.distributed's own launcher (gloo on the CPU), per-rank dumps
compared rank by rank, resume, hostfiles, profiling and the tuning switches (docs/scale.md), on
real tiny PI0 runs."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, assert_one_line_error, run_cli

from pi0align.compare import compare_dumps, windows
from pi0align.compare.reading.read_monitor import read_monitor
from pi0align.device import resolve
from pi0align.dump.monitoring.monitor_file import QUANTITIES
from pi0align.errors import UserError
from pi0align.runs.envdiff import DIFFERS, MATTERS, env_diff
from pi0align.runs.folder import read_run
from pi0align.train import checkpoint
from pi0align.train.config import TrainConfig
from pi0align.train.hostfile import cluster_from_environment, hostfile_text, launch_commands
from pi0align.train.loop import check_inputs

TWO = ("--preset", "tiny", "--batch-size", "2", "--threads", "1", "--no-progress", "--log-every", "0", "--steps", "3",
       "--save-every", "1", "--dump-steps", "0-1")


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory):
    """Two runs of 2 processes each with the same seed (3 steps, steps 0 and 1 dumped, a checkpoint
    after each step)."""
    root = tmp_path_factory.mktemp("ddp")
    made = {}
    for name in ("a", "b"):
        done = run_cli("run", *TWO, "--nproc", "2", "--out", root / name)
        assert done.returncode == 0, done.stderr[-3000:]
        made[name] = (root / name, done)
    return made


@pytest.mark.slow  # the fixture: two runs of two processes each, over a minute
def test_two_processes_write_a_dump_per_rank_and_one_summary(two_process_runs):
    run, done = two_process_runs["a"]
    assert sorted(p.name for p in run.glob("dump*.h5")) == ["dump-rank0.h5", "dump-rank1.h5"]
    assert done.stdout.count("Final Train Loss") == 1  # the three lines once, for every rank
    summary = json.loads((run / "summary.json").read_text())
    log = read_run(run, need_log=True).log
    assert summary["world_size"] == 2 and len(log) == 3
    assert summary["images_per_sec"] == pytest.approx(2 * 2 / summary["mean_step_time_s"])  # the global batch
    assert all(r["communication_s"] > 0 and r["forward_backward_s"] > 0 and r["optimizer_s"] > 0 for r in log)
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["config"]["nproc"] == 2
    # a monitor per rank: the gradients' norms after the all-reduce alike, the outputs of each rank's batch not
    assert sorted(p.name for p in run.glob("monitor*.h5")) == ["monitor-rank0.h5", "monitor-rank1.h5"]
    ranks = [read_monitor(run / f"monitor-rank{rank}.h5") for rank in (0, 1)]
    assert [m.rank for m in ranks] == [0, 1] and all(m.steps.tolist() == [0, 1, 2] for m in ranks)
    column = {q: ranks[0].quantities.index(q) for q in ("grad_norm", "output_norm")}
    gradients = [m.values[:, :, column["grad_norm"]] for m in ranks]
    assert np.allclose(gradients[0], gradients[1], rtol=1e-6, equal_nan=True)
    assert not np.allclose(ranks[0].values[:, :, column["output_norm"]], ranks[1].values[:, :, column["output_norm"]],
                           rtol=1e-3, equal_nan=True)


# Steps whose records fit in a window are judged with every rank; a step of more is judged a group
# of ranks at a time (compare/windows.py, Window): here each rank alone (a window of one record).
WINDOWS = {"every rank at once": None, "a rank at a time": 1}


@pytest.mark.slow  # the fixture's runs
@pytest.mark.parametrize("rows_per_window", WINDOWS.values(), ids=WINDOWS.keys())
def test_two_runs_of_one_seed_compare_aligned_on_every_rank(two_process_runs, rows_per_window, monkeypatch):
    if rows_per_window:
        monkeypatch.setattr(windows, "ROWS_PER_WINDOW", rows_per_window)
    result = compare_dumps(two_process_runs["a"][0], two_process_runs["b"][0], replay=False)
    assert result.verdict == "aligned" and result.rank_verdicts == {0: "aligned", 1: "aligned"}
    assert result.rows["rank"].nunique() == 2 and result.rows_over_dtype_limits == 0


@pytest.fixture(scope="module")
def faulty_rank_1(tmp_path_factory):
    """A run of 2 processes like the fixture's, every gelu of rank 1 × 1.03."""
    faulty = tmp_path_factory.mktemp("faulty") / "run"
    done = _launch(2, "-m", "pi0align.testing.faulty_rank", "1", "gelu", "1.03", "run", *TWO, "--out", faulty)
    assert done.returncode == 0, done.stderr[-3000:]
    return faulty


@pytest.mark.slow  # another run of 2 processes
def test_a_fault_on_rank_1_is_found_on_rank_1_only(two_process_runs, faulty_rank_1, monkeypatch):
    """The culprits are rank 1's; rank 0 parts only through the all-reduce (its rows after it
    fail, no call of it is blamed). Judged a rank at a time, the answer is the same row by row:
    judged alone, without rank 1's first culprit, rank 0 explained 136 of its rows that read
    rank 1's gradients."""
    answers = []
    for rows_per_window in WINDOWS.values():
        if rows_per_window:
            monkeypatch.setattr(windows, "ROWS_PER_WINDOW", rows_per_window)
        result = compare_dumps(two_process_runs["a"][0], faulty_rank_1, replay=False)
        assert result.verdict == "diverged" and result.first_divergence.rank == 1
        assert result.culprits and {c.rank for c in result.culprits} == {1}
        assert result.culprits[0].api == "Functional.gelu"
        rows = result.table(columns=["rank", "step", "name", "role", "arg_index", "verdict", "explained_by"])
        answers.append(([(c.rank, c.step, c.name) for c in result.culprits], result.rank_verdicts,
                        {column: rows[column].tolist() for column in rows.columns}))
    assert answers[0] == answers[1]


@pytest.mark.slow  # a resumed run of 2 processes
def test_a_resumed_run_of_two_processes_continues_the_same_losses(two_process_runs, tmp_path):
    """The run's folder as it stood after its checkpoint at step 2, resumed: the same losses."""
    original = two_process_runs["a"][0]
    assert losses(resumed_after_step_2(original, tmp_path)) == losses(original)


def losses(run) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_run(run, need_log=True).log]


def resumed_after_step_2(run, tmp_path):
    """A copy of the run's folder as it stood after its checkpoint at step 2, resumed from it."""
    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed, ignore=shutil.ignore_patterns("dump*", "000003"))
    log = resumed / "train_log.jsonl"
    log.write_text("".join(line + "\n" for line in log.read_text().splitlines()[:2]))
    done = run_cli("run", "--resume", resumed / "checkpoints" / "000002", "--no-progress")
    assert done.returncode == 0, done.stderr[-3000:]
    return resumed


def _launch(nproc: int, *args) -> object:
    import subprocess

    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                           str(nproc), *map(str, args)], capture_output=True, text=True, cwd=REPO, timeout=600)


def test_a_launcher_without_a_run_folder_is_one_line(tmp_path):
    assert_one_line_error(run_cli("run", "--preset", "tiny", env={"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}),
                          "--out")


# -- hostfiles -------------------------------------------------------------------------------------


def test_a_hostfile_from_each_kind_of_environment(tmp_path):
    nodes = tmp_path / "nodes.txt"
    nodes.write_text("# master first\n10.0.0.1\n10.0.0.2 extra words\n10.0.0.3\n")
    generic = cluster_from_environment({"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1",
                                        "MASTER_PORT": "6000"}, slots="16", node_list=nodes)
    assert hostfile_text(generic) == "10.0.0.1 slots=16\n10.0.0.2 slots=16\n"
    commands = launch_commands(generic, Path("hostfile"), ["--preset", "full"])
    assert commands["torchrun"] == ("torchrun --nnodes 2 --node_rank 1 --nproc_per_node 16 --master_addr 10.0.0.1 "
                                    "--master_port 6000 -m pi0align.cli.main run --preset full")
    assert commands["deepspeed"].startswith("deepspeed --hostfile hostfile --master_addr 10.0.0.1 --master_port 6000")
    platform = cluster_from_environment({"VC_WORKER_NUM": "3", "VC_TASK_INDEX": "2", "NPROC_PER_NODE": "8"},
                                        node_list=nodes)
    assert (platform.master_addr, platform.node_rank, platform.slots, len(platform.nodes)) == ("10.0.0.1", 2, 8, 3)
    without_list = cluster_from_environment({"NNODES": "2", "MASTER_ADDR": "10.0.0.1"}, slots=8)
    assert "deepspeed" not in launch_commands(without_list, None, [])  # a hostfile needs every node


@pytest.mark.parametrize(("env", "slots", "listed", "fragment"), [
    ({"NNODES": "2"}, "8", True, "MASTER_ADDR is not set"),
    ({"VC_WORKER_NUM": "4", "VC_TASK_INDEX": "0"}, "8", True, "fewer than the 4 workers"),
    ({"NNODES": "2", "MASTER_ADDR": "10.0.0.1"}, "eight", True, "must be a whole number"),
    ({"NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "10.0.0.1"}, "8", True, "not below the node count"),
    ({"VC_WORKER_NUM": "2", "VC_TASK_INDEX": "0"}, "8", False, "--node-list"),
    ({}, "8", True, "no cluster in the environment"),
])
def test_a_bad_environment_is_one_line(env, slots, listed, fragment, tmp_path):
    nodes = tmp_path / "nodes.txt"
    nodes.write_text("10.0.0.1\n10.0.0.2\n")
    with pytest.raises(UserError, match=fragment) as error:
        cluster_from_environment(env, slots=slots, node_list=nodes if listed else None)
    assert "\n" not in str(error.value)


def test_the_hostfile_command_writes_the_file_or_says_what_is_missing(tmp_path):
    nodes = tmp_path / "nodes.txt"
    nodes.write_text("10.0.0.1\n10.0.0.2\n")
    cluster = {"NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "10.0.0.1"}
    done = run_cli("hostfile", "--slots", "8", "--node-list", nodes, "--out", tmp_path / "hostfile", "--",
                   "--preset", "full", env=cluster)
    assert done.returncode == 0 and "torchrun --nnodes 2" in done.stdout and "--out DIR" in done.stdout
    assert (tmp_path / "hostfile").read_text() == "10.0.0.1 slots=8\n10.0.0.2 slots=8\n"
    assert_one_line_error(run_cli("hostfile", "--slots", "8", env={**cluster, "MASTER_ADDR": ""}), "MASTER_ADDR")


# -- profiling and the tuning switches -------------------------------------------------------------


@pytest.mark.slow  # a run in a process of its own, profiled
def test_profile_writes_a_trace_the_profilers_tools_read(tmp_path):
    done = run_cli("run", "--preset", "tiny", "--batch-size", "2", "--threads", "1", "--no-progress", "--log-every",
                   "0", "--steps", "3", "--profile", "1:3", "--out", tmp_path / "run")
    assert done.returncode == 0, done.stderr[-3000:]
    (trace,) = (tmp_path / "run" / "profile").glob("*.pt.trace.json")
    events = json.loads(trace.read_text())["traceEvents"]  # Chrome trace: TensorBoard's torch profiler, Perfetto
    steps = {event["name"] for event in events if event.get("name", "").startswith("ProfilerStep#")}
    assert steps == {"ProfilerStep#0", "ProfilerStep#1"}  # the window's two steps
    assert "Self CPU" in done.stderr  # the table of the most expensive ops
    assert_one_line_error(run_cli("run", "--preset", "tiny", "--profile", "3:1"), "--profile")


@pytest.mark.slow  # two runs, one of two processes: half a minute
def test_fused_adamw_and_core_binding_are_in_the_manifest_and_env_diff(tmp_path):
    flags = ("--preset", "tiny", "--batch-size", "2", "--threads", "1", "--no-progress", "--log-every", "0",
             "--steps", "2", "--dump-steps", "0-1")
    for name, extra in (("plain", ()), ("tuned", ("--optimizer", "adamw-fused", "--bind-cores"))):
        done = run_cli("run", *flags, *extra, "--out", tmp_path / name)
        assert done.returncode == 0, done.stderr[-3000:]
    plain, tuned = (read_run(tmp_path / name).manifest for name in ("plain", "tuned"))
    assert (tuned["config"]["optimizer"], tuned["config"]["bind_cores"]) == ("adamw-fused", True)
    status = {line.item: line.status for line in env_diff(plain, tuned).notable}
    assert status == {"optimizer": MATTERS, "cores bound": DIFFERS}
    # what the fused optimizer changes numerically: at step 0 its updates alone, by rounding (the
    # dumper counts the change a fused kernel makes without counting it: before, the updated
    # parameters were recorded with their old statistics, 100 % off)
    result = compare_dumps(tmp_path / "plain", tmp_path / "tuned", replay=False)
    rows = result.rows
    differ = rows[rows[["norm_rel_err", "mean_val_rel_err", "min_rel_err", "max_val_rel_err"]].max(axis=1) > 0]
    first = differ[differ["step"] == 0]
    assert len(first) and set(zip(first["direction"], first["role"])) == {("optimizer", "output")}
    assert result.verdict == "aligned" and not result.culprits


# -- recipes ---------------------------------------------------------------------------------------


@pytest.mark.slow  # a run in a process of its own
def test_a_recipe_sets_the_case_studys_values_and_writes_its_log_files(tmp_path):
    import argparse

    from pi0align.cli.run import add_arguments, start_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = start_from_args(parser.parse_args(["--recipe", "perf"])).config
    assert (config.steps, config.batch_size, config.nproc) == (1000, 12, 8)  # 8 cards × 12 = 96
    config = start_from_args(parser.parse_args(["--recipe", "accuracy", "--nproc", "2"])).config
    assert (config.steps, config.batch_size, config.nproc) == (20000, 12, 2)  # the flags given win
    run = tmp_path / "run"
    done = run_cli("run", "--recipe", "accuracy", "--preset", "tiny", "--steps", "2", "--nproc", "1", "--batch-size",
                   "2", "--threads", "1", "--no-progress", "--out", run)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = (run / "train_accuracy_1p_base_fp32.log").read_text().splitlines()
    assert [line.split()[:2] for line in steps] == [["step", "0"], ["step", "1"]]
    summary = (run / "Pi0_bs2_1p_acc.log").read_text().splitlines()
    assert summary == [line for line in done.stdout.splitlines() if line.startswith(("Final", "E2E"))]
    assert [line.split(":")[0] for line in summary] == ["Final Performance images/sec", "Final Train Loss",
                                                        "E2E Training Duration sec"]


# -- DeepSpeed ---------------------------------------------------------------------------------------


@pytest.mark.slow  # a minute: DeepSpeed's import and engine set-up
def test_deepspeed_in_one_process_trains_the_losses_of_torch(tmp_path):
    """ZeRO 0, one process (its own process group): the same losses, bit for bit, as the bare policy."""
    flags = ("--preset", "tiny", "--batch-size", "2", "--threads", "1", "--no-progress", "--log-every", "0",
             "--steps", "2")
    for name, extra in (("torch", ()), ("deepspeed", ("--engine", "deepspeed"))):
        done = run_cli("run", *flags, *extra, "--out", tmp_path / name)
        assert done.returncode == 0, done.stderr[-3000:]
    assert losses(tmp_path / "torch") == losses(tmp_path / "deepspeed")
    manifest = read_run(tmp_path / "deepspeed").manifest
    assert manifest["config"]["engine"] == "deepspeed" and manifest["versions"]["deepspeed"]
    # the monitor sees DeepSpeed's optimizer as torch's; where a parameter gets no gradient, DeepSpeed
    # gives it zeros, and Adam's states of zeros (0 where torch's have none), and decays it
    plain, deepspeed = (read_monitor(tmp_path / name / "monitor.h5").values for name in ("torch", "deepspeed"))
    held = np.isfinite(plain)
    assert np.allclose(plain[held], deepspeed[held], rtol=1e-5, atol=0)
    assert np.all((deepspeed[~held] == 0) | np.isnan(deepspeed[~held]))
    assert held[:, :, QUANTITIES.index("update_norm")].any()
    # its checkpoint, DeepSpeed's own files, read by ckpt-diff: the same weights within 1e-6 (the weight
    # decay of those without gradients), and Adam's states, but DeepSpeed's of those
    checkpoints = [tmp_path / name / "checkpoints" / "000002" for name in ("torch", "deepspeed")]
    done = run_cli("ckpt-diff", checkpoints[0], checkpoints[1] / "deepspeed", "--tolerance", "1e-6")
    assert done.returncode == 0, done.stdout + done.stderr
    report = tmp_path / "ckpt.json"
    done = run_cli("ckpt-diff", checkpoints[0], checkpoints[1] / "deepspeed", "--optimizer", "--tolerance", "1e-6",
                   "--json", report)
    tensors = json.loads(report.read_text())["tensors"]
    beyond = [t for t in tensors if t["relative_l2"] is None or t["relative_l2"] > 1e-6]  # None: infinite
    assert done.returncode == 1 and beyond, done.stderr
    assert all(t["shape_a"] is None and t["name"].endswith((":exp_avg", ":exp_avg_sq")) for t in beyond), beyond


@pytest.mark.slow  # two runs of 2 processes under DeepSpeed
def test_deepspeed_zero_2_on_two_processes_trains_and_resumes(two_process_runs, tmp_path):
    """ZeRO 2 over gloo: step 0 as DDP's (the same weights and batches), and a resumed run, from
    DeepSpeed's own partitioned checkpoint, continues its losses exactly."""
    run = tmp_path / "zero2"
    done = run_cli("run", *TWO, "--nproc", "2", "--engine", "deepspeed", "--zero-stage", "2", "--out", run)
    assert done.returncode == 0, done.stderr[-3000:]
    assert losses(run)[0] == losses(two_process_runs["a"][0])[0]
    assert (run / "checkpoints" / "000002" / "deepspeed").is_dir()
    monitored = read_monitor(run / "monitor-rank1.h5")
    assert np.isfinite(monitored.values[:, :, monitored.quantities.index("output_norm")]).any()
    assert losses(resumed_after_step_2(run, tmp_path)) == losses(run)
    # its optimizer state is DeepSpeed's: torch's optimizer cannot take it
    with pytest.raises(UserError, match="--engine deepspeed"):
        checkpoint.restore(run / "checkpoints" / "000002", policy=None, scheduler=None, device=resolve("cpu"),
                           optimizer=torch.optim.AdamW([torch.zeros(1)]))


def test_deepspeed_missing_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # how Python marks a module that cannot be imported
    with pytest.raises(UserError, match="DeepSpeed is not installed"):
        check_inputs(TrainConfig(preset="tiny", engine="deepspeed"))
