"""Are two runs set up alike, and how do their curves compare (docs/runs.md): env-diff, doctor,
loss curves (command, HTML page, notebook), baselines and check, and a run started from another
run's checkpoint, on real tiny PI0 runs."""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys

import pytest
from conftest import REPO, assert_one_line_error, offline_page, run_cli, run_clis

from pi0align.compare import compare_dumps
from pi0align.compare.reading.open_dump import open_run
from pi0align.runs.curves import compare_curves, load_runs
from pi0align.runs.envdiff import FOLLOWS, MATTERS, env_diff
from pi0align.runs.folder import read_run
from pi0align.runs.supported import MISMATCH, OK, SUPPORTED, Machine, doctor

TINY = ("--preset", "tiny", "--batch-size", "4", "--no-progress", "--log-every", "0")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Tiny PI0 runs of 4 steps at 1 thread, a checkpoint after each step: the base (step 2 dumped),
    the same again, another seed and learning rate, another learning rate alone, the base at 2
    threads, the base with torch's fused AdamW; and two runs
    started from the base's checkpoint at step 2, one step each, step 2 dumped, at 1 and 2 threads
    (the second repeating the base's preset and batch size, as a command line copied from it)."""
    root = tmp_path_factory.mktemp("runs")
    plain = (*TINY, "--steps", "4", "--threads", "1", "--save-every", "1")
    made = {name: root / name for name in ("base", "same", "seed_and_lr", "lr", "2_threads", "fused", "from",
                                           "from_2_threads")}
    runs = run_clis(*(("run", *plain, *extra, "--out", made[name]) for name, extra in (
        ("base", ("--dump-steps", "2")), ("same", ("--dump-steps", "2")),
        ("2_threads", ("--dump-steps", "2", "--threads", "2")),
        ("fused", ("--dump-steps", "2", "--optimizer", "adamw-fused")),
        ("seed_and_lr", ("--seed", "7", "--lr", "1e-3")), ("lr", ("--lr", "1e-3")))))
    runs += run_clis(*(("run", "--from", made["base"], "--at", "2", "--dump-steps", "2", "--threads", threads,
                        *same, "--no-progress", "--log-every", "0", "--out", made[name])
                       for name, threads, same in (("from", "1", ()), ("from_2_threads", "2", TINY[:4]))))
    for done in runs:
        assert done.returncode == 0, done.stderr
    return made


# -- env-diff -------------------------------------------------------------------------------------


def test_env_diff_names_exactly_the_seed_and_the_hyper_parameter_that_differ(runs):
    """Another seed and another learning rate: exactly those two matter; the initial weights and
    PYTHONHASHSEED follow the seed; paths and times differ with no effect."""
    diff = env_diff(read_run(runs["base"]).manifest, read_run(runs["seed_and_lr"]).manifest)
    assert {line.item for line in diff.matters} == {"seed", "learning rate"}
    assert {line.item for line in diff.notable if line.status == FOLLOWS} == {"initial weights", "PYTHONHASHSEED"}
    shown = run_cli("env-diff", runs["base"], runs["seed_and_lr"])
    assert shown.returncode == 1 and "2 matter: seed, learning rate" in shown.stdout, shown.stdout
    assert "argv" not in shown.stdout and "config.out" not in shown.stdout


def test_env_diff_of_identical_runs_is_nothing(runs):
    same = run_cli("env-diff", runs["base"], runs["same"])
    assert same.returncode == 0 and same.stdout.startswith("set up alike"), same.stdout
    assert "differs and matters" not in same.stdout and "┃" not in same.stdout  # no table


def test_tf32_on_one_side_differs_and_matters(runs, tmp_path):
    manifest = json.loads((runs["base"] / "manifest.json").read_text())
    manifest["numerics"]["cuda_matmul_allow_tf32"] = True
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    shown = run_cli("env-diff", runs["base"] / "manifest.json", tmp_path / "manifest.json", "--json",
                    tmp_path / "diff.json")
    assert shown.returncode == 1, shown.stdout
    lines = {line["item"]: line for line in json.loads((tmp_path / "diff.json").read_text())}
    assert lines["cuda_matmul_allow_tf32"]["status"] == MATTERS
    assert lines["seed"]["status"] == "same"


def test_autocast_open_on_one_side_differs_and_matters(runs):
    manifest = json.loads((runs["base"] / "manifest.json").read_text())
    autocast = json.loads(json.dumps(manifest))
    autocast["numerics"]["autocast"]["cpu"] = "bfloat16"
    assert [line.item for line in env_diff(manifest, autocast).matters] == ["autocast on cpu"]


def test_a_dump_is_set_up_as_its_run(runs):
    """A dump carries its run's manifest: env-diff reads it as it reads the run folder."""
    assert not env_diff(read_run(runs["base"] / "dump.h5").manifest, read_run(runs["base"]).manifest).notable


def test_bad_run_folders_end_in_one_line(runs, tmp_path):
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "manifest.json").write_text("{not json")
    (corrupt / "train_log.jsonl").write_text('{"step": 0, "loss": 1.0}\nnot json\n{"step": 2, "loss": 1.0}\n')
    missing = tmp_path / "missing"
    for command, fragments in ((("env-diff", missing, runs["base"]), ("no such run folder",)),
                               (("env-diff", corrupt, runs["base"]), ("manifest.json", "not JSON")),
                               (("curves", runs["base"], corrupt), ("train_log.jsonl:2", "not JSON")),
                               (("curves", runs["base"], tmp_path), ("not a run folder",)),
                               (("check", missing, "--baseline", "cpu-default"), ("no such run folder",)),
                               (("check", runs["base"], "--baseline", "nope"), ("no baseline 'nope'",))):
        assert_one_line_error(run_cli(*command), *fragments)


# -- curves ---------------------------------------------------------------------------------------


def test_curves_of_the_same_seed_are_bit_identical_and_another_learning_rate_leaves_the_band(runs):
    frame = load_runs([runs["base"], runs["same"], runs["lr"]])
    assert list(frame.columns) == ["run", "step", "loss", "grad_norm", "lr", "samples_per_s", "window",
                                   "loss_resolution"]
    assert (frame["window"] == 1).all() and (frame["loss_resolution"] == 0).all()  # every step, in full
    assert list(dict.fromkeys(frame["run"])) == ["base", "same", "lr"]  # the order given: the first is the reference
    same, lr = compare_curves(frame).differences
    assert same.identical and same.within and same.first_outside is None
    assert not lr.within and lr.first_outside is not None and lr.first_outside >= 1  # step 0 takes the same loss
    exact = run_cli("curves", runs["base"], runs["same"], "--exact")
    assert exact.returncode == 0 and "identical" in exact.stdout, exact.stdout
    apart = run_cli("curves", runs["base"], runs["lr"])
    assert apart.returncode == 1 and "outside" in apart.stdout, apart.stdout


def test_the_curves_page_shows_the_overlay_in_chromium(runs, tmp_path, browser):
    page_file = tmp_path / "curves.html"
    done = run_cli("curves", runs["base"], runs["same"], runs["lr"], "--html", page_file)
    assert done.returncode == 1, done.stderr
    with offline_page(browser, page_file) as page:
        page.wait_for_selector("#curves .main-svg")
        drawn = page.evaluate("document.getElementById('curves')._fullData.map("
                              "t => [t.name, t.line.color, t.showlegend, t.xaxis])")
        traces = [name for name, *_ in drawn]
        # three runs in each of loss, gradient norm and learning rate, two relative errors, the band
        assert len(traces) == 3 * 3 + 2 + 1 and traces.count("lr") == 4
        colours = {run: {colour for name, colour, *_ in drawn if name == run} for run in ("base", "same", "lr")}
        assert all(len(c) == 1 for c in colours.values()), colours  # one colour a run, in every panel
        assert len(set.union(*colours.values())) == 3, colours  # and a colour of its own
        in_legend = [name for name, _, shown, _ in drawn if shown and name in colours]
        assert sorted(in_legend) == sorted(colours)  # one legend: each run once
        assert page.text_content("#verdict") == "outside tolerance"


@pytest.mark.slow  # a notebook kernel of its own
def test_the_loss_curve_notebook_overlays_the_runs(runs):
    """The notebook in notebooks/ runs top to bottom (real kernel) on real run folders."""
    import os

    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.read(REPO / "notebooks" / "loss_curves.ipynb", as_version=4)
    os.environ["PI0ALIGN_RUNS"] = str(runs["base"].parent / "[bls]*")  # base, lr, same, seed_and_lr
    try:
        NotebookClient(notebook, timeout=300, kernel_name="python3",
                       resources={"metadata": {"path": str(REPO / "notebooks")}}).execute()
    finally:
        del os.environ["PI0ALIGN_RUNS"]
    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]
    text = "".join(output.get("text", "") for output in outputs)
    assert "4 run(s): base, lr, same, seed_and_lr" in text and "lr: mean relative loss error" in text
    figure = next(o["data"]["application/vnd.plotly.v1+json"] for o in outputs
                  if "application/vnd.plotly.v1+json" in o.get("data", {}))
    assert len(figure["data"]) == 4 * 3 + 3 + 1  # 4 runs × 3 metrics, 3 relative errors, the band
    assert figure["data"][0]["y"]  # the loss curve has points


# -- baselines and check ------------------------------------------------------------------------


def test_check_passes_a_run_against_its_own_baseline_and_fails_another_learning_rate(runs, tmp_path):
    recorded = run_cli("check", runs["base"], "--save-baseline", "tiny", "--baselines", tmp_path)
    assert recorded.returncode == 0, recorded.stderr
    # throughput is the machine's load, not the run's (the runs were made two at a time)
    own = run_cli("check", runs["same"], "--baseline", "tiny", "--baselines", tmp_path, "--min-throughput", "0")
    assert own.returncode == 0 and "passed" in own.stdout, own.stdout
    other = run_cli("check", runs["lr"], "--baseline", "tiny", "--baselines", tmp_path)
    assert other.returncode == 1 and "failed" in other.stdout and "learning rate" in other.stdout, other.stdout


def test_a_documented_baseline_holds_no_results_to_check_against(runs):
    assert_one_line_error(run_cli("check", runs["base"], "--baseline", "pi0-8p-reference"),
                          "pi0-8p-reference", "--save-baseline")


@pytest.mark.slow  # the default job (50 steps of PI0 small), twice
def test_the_default_run_passes_its_baseline_and_another_learning_rate_fails(tmp_path):
    for name, extra in (("default", ()), ("lr", ("--lr", "1e-4"))):
        done = run_cli("run", "--no-progress", "--log-every", "0", *extra, "--out", tmp_path / name)
        assert done.returncode == 0, done.stderr
    # throughput is the machine's load, not the run's: the losses are judged
    passed = run_cli("check", tmp_path / "default", "--baseline", "cpu-default", "--min-throughput", "0")
    assert passed.returncode == 0, passed.stdout
    failed = run_cli("check", tmp_path / "lr", "--baseline", "cpu-default", "--min-throughput", "0")
    assert failed.returncode == 1 and "loss curve" in failed.stdout, failed.stdout


# -- a late divergence from identical state ------------------------------------------------------


def test_a_run_from_another_runs_checkpoint_computes_its_step_bit_for_bit(runs):
    """Started from the base's checkpoint at step 2 at the same thread count: step 2 dumps the same
    bits, record by record, and takes the same loss; at another thread count, aligned."""
    (base,), (again,) = (open_run(runs[name], {2}).values() for name in ("base", "from"))
    assert len(base.records) > 1000 and (base.records["checksum"] == again.records["checksum"]).all()
    base_loss = next(r["loss"] for r in read_run(runs["base"], need_log=True).log if r["step"] == 2)
    assert [r["loss"] for r in read_run(runs["from"], need_log=True).log] == [base_loss]
    result = compare_dumps(runs["base"], runs["from_2_threads"], steps={2}, replay=False)
    assert result.verdict == "aligned" and not result.culprits
    manifest = read_run(runs["from"]).manifest
    assert manifest["started_from"] == {"run": str(runs["base"]), "step": 2}


def test_a_resumed_run_never_writes_over_the_steps_its_folder_dumped_before(runs, tmp_path):
    """`run --resume` with --dump-steps, where the folder already holds the dump of the steps run
    before: one line, and the dump untouched (before: replaced by one of the resumed steps only)."""
    folder = shutil.copytree(runs["base"], tmp_path / "base")
    before = (folder / "dump.h5").read_bytes()
    done = run_cli("run", "--resume", folder / "checkpoints" / "000003", "--dump-steps", "3", "--no-progress")
    assert_one_line_error(done, "dump.h5 holds the steps this run dumped before", "--dump-steps")
    assert (folder / "dump.h5").read_bytes() == before


def test_runs_at_another_thread_count_first_dumped_at_step_2_are_aligned(runs):
    """1 against 2 threads, step 2 the first dumped: the updates before it made different noise
    of the attention key biases' gradients (zero in exact arithmetic) into parameters and optimizer
    states that part far beyond fp32's limits. Judged as what those updates made of noise from the
    same start (a gradient at rounding level counting as noise alone): aligned. Before: diverged, a
    key bias named as "parameters differ where nothing dumped changed them"."""
    result = compare_dumps(runs["base"], runs["2_threads"], replay=False)
    assert result.verdict == "aligned" and not result.culprits, result.notes[-2:]
    assert result.explained.get("gap") and result.rows_over_dtype_limits > 0


def test_runs_whose_adamw_is_fused_on_one_side_are_aligned(runs):
    """torch's fused AdamW against PI0's: the same update computed in another order, step 2 the
    first dumped. The fused side's rounding parts the parameters by step 2 (a key bias's noise
    gradient made into updates): judged as noise from the same start, aligned. Before: the runs
    were taken as computing bit for bit alike (same device and threads), and a key bias was named."""
    assert [line.item for line in env_diff(read_run(runs["base"]).manifest,
                                           read_run(runs["fused"]).manifest).matters] == ["optimizer"]
    result = compare_dumps(runs["base"], runs["fused"], replay=False)
    assert result.verdict == "aligned" and not result.culprits, result.notes[-2:]
    assert result.rows_over_dtype_limits > 0


@pytest.mark.slow  # processes that import torch and LeRobot, one after the other
def test_from_takes_the_other_runs_configuration_and_says_what_is_wrong(runs, tmp_path):
    out = ("--out", tmp_path / "x")
    for args, fragments in ((("--from", runs["base"]), ("--at",)),
                            (("--from", runs["base"], "--at", "9"), ("9 steps",)),
                            (("--from", runs["base"], "--at", "2", "--lr", "1"), ("--lr", "cannot change")),
                            (("--from", runs["base"], "--at", "3", "--steps", "2"), ("runs past",)),
                            (("--at", "2"), ("--from",))):
        assert_one_line_error(run_cli("run", *args, *out), *fragments)
    assert not (tmp_path / "x").exists()


# -- doctor -------------------------------------------------------------------------------------


def test_doctor_passes_this_machine_and_names_what_an_npu_machine_lacks():
    shown = run_cli("doctor", env={"OMP_NUM_THREADS": "2"})
    assert shown.returncode == 0 and "torch" in shown.stdout and "mismatch" not in shown.stdout, shown.stdout
    threads = next(line for line in shown.stdout.splitlines() if "CPU threads" in line)
    assert threads.split("│")[-2].strip() == "ok", threads
    npu = doctor(Machine(versions={"python": "3.11.7", "torch": "2.14.1", "torchvision": "0.29.1",
                                   "transformers": "4.57.6", "lerobot": "0.4.4", "torch_npu": "2.1.0.post6",
                                   "cann": "8.2.RC1"}, devices=("cpu", "npu"), environment={}))
    status = {finding.check: finding.status for finding in npu.findings}
    assert not npu and status["torch_npu"] == MISMATCH and status["cann"] == OK
    assert status["HCCL_DETERMINISTIC"] == MISMATCH


def test_doctor_warns_of_an_unset_thread_count_and_names_the_host_cpu():
    """Unset is not fixed: a warning with the line to set (before: `ok`); the host's CPU (its
    architecture, torch's code path, BLAS) is named, since two hosts' kernels round otherwise."""
    env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    shown = subprocess.run([sys.executable, "-m", "pi0align.cli.main", "doctor"], capture_output=True, text=True,
                           env={**env, "COLUMNS": "80", "ATEN_CPU_CAPABILITY": "default"}, cwd=REPO)
    assert shown.returncode == 0, shown.stderr  # supported, with a warning
    lines = shown.stdout.splitlines()
    threads = next(line for line in lines if "CPU threads" in line and "│" in line)
    assert [cell.strip() for cell in threads.split("│")[1:-1]] == ["CPU threads", "unset", "fixed", "warning"]
    assert "--threads N" in shown.stdout and "OMP_NUM_THREADS=N" in shown.stdout
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in lines if line.count("│") == 5]
    at = next(i for i, row in enumerate(rows) if row[0] == "host CPU")
    continued = [row for row in rows[at + 1:] if row[0] == ""][:len(rows) - at - 1]
    host = " ".join(row[1] for row in [rows[at], *continued])
    assert platform.machine() in host and "DEFAULT forced" in host, host
    assert "ATEN_CPU_CAPABILITY=default" in shown.stdout


def test_the_supported_versions_page_shows_the_table():
    page = (REPO / "docs" / "supported-versions.md").read_text()
    for requirement in SUPPORTED:
        assert f"| `{requirement.name}` | `{requirement.specifier}` |" in page, requirement.name


def test_a_run_killed_mid_line_reads_up_to_its_last_whole_step(runs, tmp_path):
    shutil.copytree(runs["base"], tmp_path / "killed", ignore=shutil.ignore_patterns("checkpoints", "dump.h5*"))
    log = tmp_path / "killed" / "train_log.jsonl"
    log.write_text(log.read_text() + '{"step": 4, "lo')
    assert [r["step"] for r in read_run(tmp_path / "killed", need_log=True).log] == [0, 1, 2, 3]


# -- names at 80 columns --------------------------------------------------------------------------


def _broken_names(text: str, components: set[str]) -> list[str]:
    """Where a line ends inside a module path's part and the next line goes on with it (`…encoder.la`
    then `yers.0`): the pairs of lines, or of the same cell of a table's two lines, that do."""
    lines, broken = text.splitlines(), []
    for upper, lower in zip(lines, lines[1:]):
        cells = (list(zip(re.split("[│┃]", upper), re.split("[│┃]", lower)))
                 if upper.count("│") == lower.count("│") > 1 else [(upper, lower)])
        for left, right in cells:
            tail, head = re.search(r"\w+$", left.rstrip()), re.match(r"\w+", right.strip())
            if tail and head and tail.group() + head.group() in components and left.rstrip() == left.rstrip(" "):
                broken.append(f"{upper!r} / {lower!r}")
    return broken


def test_no_console_line_at_80_columns_breaks_inside_a_module_path_part(runs, tmp_path):
    """compare, env-diff, curves, doctor and check at 80 columns on real PI0 names (up to 140
    characters): every line fits, and no name is cut inside one of its parts (before: notes and
    panels printed `…vision_model.encoder.la` / `yers.0.self_attn.k_proj.bias/Parameter#0`)."""
    (dump,) = open_run(runs["base"]).values()
    modules = set(dump.records["module"].tolist())
    dump.close()
    components = {part for module in modules for part in module.split(".") if re.search("[A-Za-z]", part)}
    assert max(map(len, modules)) > 80  # the names are long enough to need it
    baselines = tmp_path / "baselines"
    assert run_cli("check", runs["base"], "--save-baseline", "tiny", "--baselines", baselines).returncode == 0
    commands = [("compare", runs["base"], runs["2_threads"], "--no-html"),
                ("compare", runs["base"], runs["fused"], "--no-html"),
                ("compare", runs["base"], runs["seed_and_lr"], "--no-html", "--steps", "2"),
                ("env-diff", runs["base"], runs["seed_and_lr"]), ("curves", runs["base"], runs["lr"]),
                ("doctor",), ("check", runs["lr"], "--baseline", "tiny", "--baselines", baselines)]
    for command in commands:
        done = run_cli(*command, env={"COLUMNS": "80"})
        assert done.returncode in (0, 1, 2) and "Traceback" not in done.stderr, done.stderr
        assert all(len(line) <= 80 for line in done.stdout.splitlines()), (command, done.stdout)
        assert _broken_names(done.stdout, components) == [], (command[0], _broken_names(done.stdout, components))
