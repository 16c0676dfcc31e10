"""A compare of many steps judges a window of steps at a time (compare/conclusion.py) and keeps its
rows on disk: what a window needs of the ones before it is carried (the parameters' latest calls,
the optimizer's latest states, the first culprit), so real toy trainings judged in windows of a
step or two get the answer of the same trainings judged whole, row by row; and the compare's
memory does not grow with the number of steps."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from pi0align.compare import compare_dumps, windows
from pi0align.testing.dumpfactory import Call, Step, default_manifest, write_dump, write_msprobe_dump
from pi0align.testing.scenarios import NOISY, Emulation, ToyRun, dump_toy

FOUR_STEPS = {"steps": 4, "dumped": (0, 1, 2, 3)}
GAPS = {"steps": 5, "dumped": (0, 2, 4)}
CASES = {
    # bf16 noise, statistics: aligned, every window
    "noise": (ToyRun(dtype="bf16", mode="stats", **FOUR_STEPS), ToyRun(dtype="bf16", mode="stats", device=NOISY,
                                                                       **FOUR_STEPS)),
    # another eps, updates not recorded: the parameters of step 1 part, read through the window's edge
    "eps, updates not recorded": (ToyRun(record_optimizer=False, mode="stats", **FOUR_STEPS),
                                  ToyRun(record_optimizer=False, mode="stats", eps=1e-6, **FOUR_STEPS)),
    # steps 0 and 2 dumped, one a window: the update between them stands for itself
    "a gap of steps": (ToyRun(record_optimizer=False, mode="stats", steps=3, dumped=(0, 2)),
                       ToyRun(record_optimizer=False, mode="stats", steps=3, dumped=(0, 2), eps=1e-6)),
    # a fault at step 0 only: the later windows inherit it, and blame no one
    "a fault at step 0 only": (ToyRun(mode="stats", **FOUR_STEPS),
                               ToyRun(mode="stats", device=Emulation(fault=("blocks.2.2", "gelu", 0, 1.03),
                                                                    fault_forwards=1), **FOUR_STEPS)),
    # one sample changed at step 3, in the last window: the batch, not the parameters before it
    "a sample changed at step 3": (ToyRun(mode="stats", **FOUR_STEPS),
                                   ToyRun(mode="stats", changed_sample_at=3, **FOUR_STEPS)),
    # the optimizer recorded, full tensors: its states read at the next window's first step
    "updates recorded, tensors": (ToyRun(**FOUR_STEPS), ToyRun(device=Emulation(ulp_noise=1), **FOUR_STEPS)),
    # steps 0, 2 and 4 dumped, the updates between not: the states each reads, from the window before
    "noise, gaps of steps": (ToyRun(dtype="bf16", mode="stats", **GAPS),
                             ToyRun(dtype="bf16", mode="stats", device=NOISY, device_name="emulated", **GAPS)),
    # and a gradient off in step 1, not dumped: the update at step 2 reads states beyond the gap's bound
    "a gradient off in a gap": (ToyRun(model="transformer", mode="stats", **GAPS),
                                ToyRun(model="transformer", mode="stats", sdpa=True,
                                       gradient_scaled=("layers.0.mlp.0.weight", 1.0003, 1), **GAPS)),
}
JUDGED = ["step", "name", "direction", "role", "arg_index", "pairing", "verdict", "explained_by", "introduced_error"]


def _answer(result):
    rows = result.table(columns=JUDGED)
    culprits = [(c.step, c.name, c.kind, c.direction) for c in result.culprits]
    first = result.first_divergence
    return (result.verdict, first and (first.step, first.name, first.kind), culprits,
            [(g.kind, g.api, g.count, g.calls) for g in result.culprit_groups], result.explained,
            {column: [None if value != value else value for value in rows[column].tolist()] for column in JUDGED})


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    folder = tmp_path_factory.mktemp("windows")
    return {name: (dump_toy(folder / f"{n}a", a), dump_toy(folder / f"{n}b", b))
            for n, (name, (a, b)) in enumerate(CASES.items())}


# A call's peers (judge.stands_out) are the calls of its API in its window: one step of the toy MLP
# holds three gelu calls, too few to have peers, so in windows of one step the noise case's gelu
# stands out; a window of ROWS_PER_WINDOW records holds dozens of calls of every API that repeats.
# The replayed tensor case (seconds a compare) in windows of one step only: the most edges.
@pytest.mark.parametrize(("name", "steps_per_window"),
                         [(name, 2) for name in CASES if name != "updates recorded, tensors"]
                         + [(name, 1) for name in CASES if not name.startswith("noise")])
def test_judged_in_windows_of_steps_the_answer_is_the_whole_ones(dumps, name, steps_per_window, monkeypatch):
    a, b = dumps[name]
    whole = compare_dumps(a, b)
    largest_step = np.unique(whole.table(columns=["step"])["step"], return_counts=True)[1].max()
    monkeypatch.setattr(windows, "ROWS_PER_WINDOW", int(largest_step * steps_per_window))
    windowed = compare_dumps(a, b)
    assert windowed.rows_over_dtype_limits == whole.rows_over_dtype_limits
    assert _answer(windowed) == _answer(whole)


def test_the_answers_are_the_cases(dumps):
    """The cases stand for what their names say (judged whole)."""
    answers = {name: compare_dumps(*dumps[name]) for name in CASES}
    assert answers["noise"].verdict == "aligned"
    assert answers["noise, gaps of steps"].verdict == "aligned" and answers["noise, gaps of steps"].explained["gap"]
    first = answers["a gradient off in a gap"].first_divergence
    assert (first.kind, first.step, first.name) == ("optimizer", 2, "layers.0.mlp.0.weight/Optimizer.step#0")
    assert answers["updates recorded, tensors"].verdict == "aligned"
    for name in ("eps, updates not recorded", "a gap of steps"):
        first = answers[name].first_divergence
        assert answers[name].verdict == "diverged" and first.kind == "optimizer", name
    assert answers["a gap of steps"].first_divergence.step == 2
    assert {c.step for c in answers["a fault at step 0 only"].culprits} == {0}
    first = answers["a sample changed at step 3"].first_divergence
    assert (first.kind, first.step) == ("data", 3)


STEPS = 60
CALLS = 200  # a chain of tanh calls a step


def _stats_dump(path, steps=STEPS, calls=CALLS, rank=0, world_size=1):
    """`steps` steps of a chain of `calls` calls, float32 statistics, as one rank's file."""
    rng = np.random.default_rng(0)
    chains = []
    for step in range(steps):
        value = rng.standard_normal((8, 64)).astype(np.float32)
        chain = []
        for i in range(calls):
            output = np.tanh(value).astype(np.float32)
            chain.append(Call(f"layers.{i}/Functional.tanh#0", f"layers.{i}", "Functional.tanh", "forward",
                              [("input", 0, value), ("output", 0, output)]))
            value = output
        chains.append(Step(step, chain, 1.0, 1.0, 1e-3))
    return write_dump(path, chains, mode="stats", rank=rank, world_size=world_size,
                      manifest=default_manifest(rank=rank, world_size=world_size))


def _compare_peak(dump, rows_per_window: int, steps: int) -> tuple[str, int, int]:
    """(verdict, rows, peak resident KiB) of a compare of `dump` with itself at its first `steps`
    steps, in windows of `rows_per_window` records, in a process of its own."""
    # VmHWM, the process's own peak (ru_maxrss would carry over this forking process's)
    script = ("import json, sys; from pi0align.compare import windows, compare_dumps; "
              f"windows.ROWS_PER_WINDOW = {rows_per_window}; "
              "r = compare_dumps(sys.argv[1], sys.argv[1], steps=range(int(sys.argv[2]))); "
              "peak = next(int(line.split()[1]) for line in open('/proc/self/status') if line.startswith('VmHWM')); "
              "print(json.dumps([r.verdict, sum(len(p) for p in r.row_parts(['step'])), peak]))")
    done = subprocess.run([sys.executable, "-c", script, str(dump), str(steps)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return tuple(json.loads(done.stdout))


def test_a_compare_holds_one_window_of_rows_whatever_the_number_of_steps(tmp_path):
    """Peak memory of compares of the first sixth of the steps and of all of them (24,000 rows),
    windows of five steps: the same within 16 MiB (4 MiB here; judged whole, 60 MiB more)."""
    dump = _stats_dump(tmp_path / "a.h5")
    peaks = {}
    for steps in (STEPS // 6, STEPS):
        verdict, rows, peaks[steps] = _compare_peak(dump, 5 * CALLS * 2, steps)
        assert (verdict, rows) == ("aligned", steps * CALLS * 2)
    assert peaks[STEPS] - peaks[STEPS // 6] < 16 << 10, peaks


RANK_CALLS = 4_000  # a rank's calls a step: a step of eight ranks holds 64,000 records


def test_a_step_of_many_ranks_is_judged_a_group_of_ranks_at_a_time(tmp_path):
    """Peak memory of compares of two ranks and of eight, a step of 16,000 and of 64,000 records,
    in windows of one rank's step: the same within 16 MiB (7 MiB here; held whole, the eight
    ranks' step took 109 MiB more). Two ranks, not one: both measure their ranks in processes of
    their own (engine._workers)."""
    peaks = {}
    for ranks in (2, 8):
        run = tmp_path / f"ranks{ranks}"
        for rank in range(ranks):
            _stats_dump(run / f"dump-rank{rank}.h5", steps=1, calls=RANK_CALLS, rank=rank, world_size=ranks)
        verdict, rows, peaks[ranks] = _compare_peak(run, RANK_CALLS * 2, 1)
        assert (verdict, rows) == ("aligned", ranks * RANK_CALLS * 2)
    assert peaks[8] - peaks[2] < 16 << 10, peaks


@pytest.mark.skipif(importlib.util.find_spec("msprobe") is None, reason="mindstudio-probe not installed")
def test_msprobe_dumps_of_other_steps_are_judged_in_windows_too(tmp_path, monkeypatch):
    """msprobe's dumps, a step in each window, one step that B lacks: the steps both hold are
    compared, whole and in windows alike, and the step A alone holds is said, not compared (its
    records, once listed as A's only, made two runs dumped at other steps "diverged":
    scenarios.gap_cases)."""
    a = write_msprobe_dump(tmp_path / "a", steps=3)
    b = tmp_path / "b"
    shutil.copytree(a, b)
    shutil.rmtree(next(b.glob("step2")))
    whole = compare_dumps(a, b)
    monkeypatch.setattr(windows, "ROWS_PER_WINDOW", 1)
    windowed = compare_dumps(a, b)
    assert whole.coverage["only_a"] == 0 and windowed.coverage == whole.coverage
    assert "step 2 held by A only: not compared" in whole.notes
    assert _answer(windowed) == _answer(whole)
