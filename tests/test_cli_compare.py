"""`pi0align compare` end to end on real dump files (pi0align/testing/dumpfactory.py): exit codes, outputs,
one-line errors, no torch, and the HTML report of a real fault in the browser."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pandas as pd
import pytest
from conftest import assert_one_line_error, run_cli
from test_report_html import column_texts

from pi0align.cli.main import main
from pi0align.testing.dumpfactory import Fault, run_toy_model, write_dump

FAULT = Fault("model.layers.1.linear/Functional.linear#0")
FAULT_MODULE = "model.layers.1.linear"


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dumps")
    reference = run_toy_model(seed=0, steps=2)
    return {
        "gpu": write_dump(folder / "gpu" / "dump.h5", reference, mode="tensor"),
        "same": write_dump(folder / "same" / "dump.h5", reference, mode="tensor"),
        "fault": write_dump(folder / "npu" / "dump.h5", run_toy_model(seed=0, steps=2, fault=FAULT), mode="tensor"),
        "noop": write_dump(folder / "noop" / "dump.h5", run_toy_model(seed=0, steps=2, extra_noop="model.layers.1"),
                           mode="tensor"),
        "seed1": write_dump(folder / "seed1" / "dump.h5", run_toy_model(seed=1, steps=2), mode="tensor"),
        "corrupt": _write(folder / "corrupt.h5", b"\x89HDF\r\n\x1a\n but not really"),
    }


def _write(path, data: bytes):
    path.write_bytes(data)
    return path


def compare(*args, cwd) -> subprocess.CompletedProcess:
    """Run `pi0align compare` as a user would, in a fresh process, from `cwd` (where reports/ goes)."""
    return subprocess.run([sys.executable, "-m", "pi0align.cli.main", "compare", *map(str, args)],
                          capture_output=True, text=True, cwd=cwd)


def test_same_run_twice_is_aligned_and_writes_every_output(dumps, tmp_path):
    run = compare(dumps["gpu"], dumps["same"], "--csv", tmp_path / "rows.csv", "--json", tmp_path / "summary.json",
                  cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "ALIGNED" in run.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["verdict"] == "aligned" and summary["first_divergence"] is None and summary["culprits"] == []
    assert summary["coverage"]["only_a"] == summary["coverage"]["only_b"] == 0
    rows = pd.read_csv(tmp_path / "rows.csv")
    assert len(rows) == summary["coverage"]["matched"] and set(rows["verdict"]) == {"pass"}
    assert (tmp_path / "reports" / "gpu-vs-same.html").is_file()  # the default HTML report


def test_injected_fault_is_the_first_divergence_and_top_culprit(dumps, tmp_path, capsys):
    code = main(["compare", str(dumps["gpu"]), str(dumps["fault"]), "--json", str(tmp_path / "summary.json"),
                 "--no-html", "--top", "3"])
    out = capsys.readouterr().out
    assert code == 1
    assert "DIVERGED" in out and FAULT_MODULE in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["verdict"] == "diverged"
    assert summary["first_divergence"]["name"] == FAULT.name and summary["first_divergence"]["step"] == 0
    assert summary["culprits"][0]["name"] == FAULT.name and summary["culprits"][0]["module"] == FAULT_MODULE
    assert summary["culprits"][0]["stack"]  # where to look
    assert not (tmp_path / "reports").exists()


def test_different_seeds_diverge(dumps, tmp_path):
    run = compare(dumps["gpu"], dumps["seed1"], "--no-html", cwd=tmp_path)
    assert run.returncode == 1, run.stderr
    assert "DIVERGED" in run.stdout


def test_extra_call_on_one_side_is_aligned_and_listed(dumps, tmp_path, capsys):
    code = main(["compare", str(dumps["gpu"]), str(dumps["noop"]), "--json", str(tmp_path / "summary.json"),
                 "--no-html"])
    out = capsys.readouterr().out
    assert code == 0
    assert "records on one side only" in out and "model.layers.1/Tensor.__add__#0" in out
    coverage = json.loads((tmp_path / "summary.json").read_text())["coverage"]
    assert coverage["only_a"] == 0 and coverage["only_b"] > 0


def test_calibrated_thresholds_keep_the_same_run_aligned(dumps, tmp_path, capsys):
    code = main(["compare", str(dumps["gpu"]), str(dumps["same"]), "--calibrate", str(dumps["gpu"]),
                 str(dumps["same"]), "--json", str(tmp_path / "summary.json"), "--no-html"])
    assert code == 0
    assert json.loads((tmp_path / "summary.json").read_text())["verdict"] == "aligned"


def test_threshold_overrides_win_over_calibration(dumps, tmp_path):
    main(["compare", str(dumps["gpu"]), str(dumps["same"]), "--calibrate", str(dumps["gpu"]), str(dumps["same"]),
          "--threshold", "fp32.rel_l2_err=0.125", "--json", str(tmp_path / "summary.json"), "--no-html"])
    thresholds = json.loads((tmp_path / "summary.json").read_text())["thresholds"]
    assert thresholds["float32"]["rel_l2_err"] == 0.125
    assert thresholds["float32"]["norm_rel_err"] != load_default("float32", "norm_rel_err")  # calibrated


def load_default(dtype: str, metric: str) -> float:
    from pi0align.compare import load_thresholds

    return load_thresholds()[dtype][metric]


@pytest.mark.parametrize("arguments, message", [
    (["{missing}", "{gpu}"], "missing.h5"),
    (["{corrupt}", "{gpu}"], "corrupt.h5"),
    (["{gpu}", "{fault}", "--threshold", "fp32.no_such_metric=1"], "no_such_metric"),
    (["{gpu}", "{fault}", "--thresholds", "{missing}"], "missing.h5"),
    (["{gpu}", "{fault}", "--calibrate", "{gpu}", "{missing}"], "missing.h5"),
    (["{gpu}", "{fault}", "--json", "{corrupt}/summary.json"], "summary.json"),
    (["{gpu}", "{fault}", "--steps", "three"], "steps"),
    (["{gpu}", "{fault}", "--steps", "7-9"], "none of the steps asked for (7, 8, 9)"),
])
def test_bad_input_is_one_line_and_exit_2(dumps, tmp_path, arguments, message):
    paths = {name: str(path) for name, path in dumps.items()} | {"missing": str(tmp_path / "missing.h5")}
    assert_one_line_error(compare(*(argument.format(**paths) for argument in arguments), "--no-html", cwd=tmp_path),
                          message)


def test_missing_plotly_is_said_in_one_line_before_comparing(dumps, tmp_path):
    script = (
        "import sys\n"
        "sys.modules['plotly'] = None  # as if plotly were not installed\n"
        "from pi0align.cli.main import main\n"
        f"sys.exit(main(['compare', {str(dumps['gpu'])!r}, {str(dumps['fault'])!r}]))\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 2
    assert run.stderr.strip() == ("pi0align compare: error: the HTML report needs plotly: pip install plotly, "
                                  "or pass --no-html")
    assert run.stdout == ""  # said before comparing


def test_replay_without_torch_is_said_in_one_line_and_no_replay_still_compares(dumps, tmp_path):
    """compare runs where only the dumps are; of full tensors, its replay needs torch."""
    no_torch = ("import sys; sys.modules['torch'] = None\n"  # as if torch were not installed
                "from pi0align.cli.main import main; sys.exit(main(sys.argv[1:]))")
    run = lambda *extra: subprocess.run(  # noqa: E731
        [sys.executable, "-c", no_torch, "compare", str(dumps["gpu"]), str(dumps["fault"]), "--no-html", *extra],
        capture_output=True, text=True, cwd=tmp_path)
    assert_one_line_error(run(), "needs torch", "--no-replay")
    without = run("--no-replay")
    assert without.returncode == 1 and "DIVERGED" in without.stdout, without.stderr


def test_compare_imports_neither_torch_nor_pandas(dumps, tmp_path):
    """Every output of `pi0align compare`, on our dumps and on msprobe's: no torch (it runs where
    only the dumps are), no pandas and hence no pyarrow (a third of a second to import). Full
    tensors are replayed in float64 with torch unless --no-replay says otherwise."""
    msprobe = str(_msprobe_dump(tmp_path / "msprobe"))
    runs = [([str(dumps["gpu"]), str(dumps["fault"]), "--json", "s.json", "--csv", "r.csv", "--no-replay"], 1),
            ([msprobe, msprobe, "--csv", "m.csv", "--html", "m.html"], 0)]
    assert _imported(runs, {"torch", "pandas", "pyarrow"}, tmp_path) == "[]"
    assert (tmp_path / "reports" / "gpu-vs-npu.html").is_file() and (tmp_path / "m.html").is_file()


def test_a_compare_of_msprobe_dumps_imports_only_what_it_uses(tmp_path):
    """A compare of small statistics dumps is mostly the command's start-up. msprobe's dumps are
    JSON: h5py (a tenth of the time of a compare of statistics) stays out; so do OpenSSL's hashlib,
    tomllib and the native build's subprocess, which only sampling, a TOML thresholds file and a
    build of compiled loops need."""
    msprobe = str(_msprobe_dump(tmp_path / "msprobe"))
    watched = {"h5py", "hdf5plugin", "hashlib", "tomllib", "subprocess"}
    assert _imported([([msprobe, msprobe, "--no-html", "--csv", "m.csv"], 0)], watched, tmp_path) == "[]"


def _imported(runs: list[tuple[list[str], int]], watched: set[str], cwd) -> str:
    """Which of the `watched` packages these `pi0align compare` runs ((arguments, exit code), in one
    new process) imported, as a printed list."""
    lines = ["import sys", "from pi0align.cli.main import main"]
    for arguments, code in runs:
        lines += [f"code = main(['compare', *{arguments!r}])", f"assert code == {code}, code"]
    lines.append(f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({sorted(watched)!r})))")
    run = subprocess.run([sys.executable, "-c", "\n".join(lines)], capture_output=True, text=True, cwd=cwd)
    assert run.returncode == 0, run.stderr
    return run.stdout.splitlines()[-1]


def _msprobe_dump(folder):
    """A one-call msprobe statistics dump (step0/rank0/dump.json)."""
    tensor = {"type": "torch.Tensor", "dtype": "torch.float32", "shape": [2, 3], "Max": 1.0, "Min": -1.0,
              "Mean": 0.0, "Norm": 2.0, "requires_grad": False}
    data = {"Functional.linear.0.forward": {"input_args": [tensor, tensor], "input_kwargs": {}, "output": [tensor]}}
    rank = folder / "step0" / "rank0"
    rank.mkdir(parents=True)
    (rank / "dump.json").write_text(json.dumps({"task": "statistics", "level": "L1", "framework": "pytorch",
                                                "dump_data_dir": None, "data": data}))
    return folder


@pytest.mark.browser
def test_html_report_of_a_real_fault_shows_the_culprit_and_sorts(dumps, tmp_path, browser):  # noqa: F811
    html = tmp_path / "report.html"
    assert main(["compare", str(dumps["gpu"]), str(dumps["fault"]), "--html", str(html)]) == 1
    context = browser.new_context()
    blocked = []
    context.route("**/*", lambda route: route.continue_() if route.request.url.startswith("file:")
                  else (blocked.append(route.request.url), route.abort()))
    page = context.new_page()
    page.goto(html.as_uri())
    page.wait_for_selector("#chart-errors .main-svg")
    assert FAULT_MODULE in page.inner_text("#culprits tbody tr:first-child")
    page.locator("#rows-table th[data-column='introduced_error']").click()
    page.locator("#rows-table th[data-column='introduced_error']").click()  # descending
    assert column_texts(page, "name")[0] == FAULT.name
    context.close()
    assert blocked == []


def test_the_top_level_help_is_for_users():
    """`pi0align --help` says what the tool does and shows examples, in 80 columns, without the
    developers' words."""
    done = run_cli("--help")
    assert done.returncode == 0
    assert "entry point" not in done.stdout and "dispatch" not in done.stdout
    assert "pi0align compare dumps/gpu dumps/npu" in done.stdout and "two runs part" in done.stdout
    assert max(len(line) for line in done.stdout.splitlines()) <= 80


@pytest.mark.skipif(importlib.util.find_spec("msprobe") is None, reason="mindstudio-probe not installed")
@pytest.mark.slow  # four toy runs under msprobe, each a process importing torch and msprobe
@pytest.mark.parametrize("level", ["L1", "mix"])
def test_msprobe_dumps_of_another_adam_eps_report_the_optimizer(level, tmp_path):
    """msprobe's PrecisionDebugger around each step, optimizer.step() inside its window, AdamW's
    eps 1e-8 against 1e-4: a report on the console (before: a traceback once the verdict was
    printed), the JSON written with the default --top, and the first divergence, the culprit and
    its group the optimizer's (its arithmetic inside optimizer.step(), not a kernel of Tensor.add_)."""
    dumps = {}
    for name, eps in (("a", 1e-8), ("b", 1e-4)):
        dumps[name] = tmp_path / name
        done = subprocess.run([sys.executable, "-c", "from pi0align.testing.scenarios import ToyRun, "
                               f"dump_toy_with_msprobe; dump_toy_with_msprobe({str(dumps[name])!r}, "
                               f"ToyRun(eps={eps}), level={level!r})"], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
    run = compare(dumps["a"], dumps["b"], "--no-html", "--json", tmp_path / "c.json", cwd=tmp_path)
    assert run.returncode == 1, run.stderr
    assert "Traceback" not in run.stderr and "top culprits" in run.stdout
    report = json.loads((tmp_path / "c.json").read_text())
    first, culprit, group = report["first_divergence"], report["culprits"][0], report["culprit_groups"][0]
    assert (first["kind"], first["direction"], first["api"], first["step"]) == (
        "optimizer", "in_optimizer", "Tensor.add_", 0)
    assert (culprit["kind"], culprit["step"]) == ("optimizer", 0)
    assert group["kind"] == "optimizer" and "compare the optimizers' settings" in group["hint"]
