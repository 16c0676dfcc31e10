"""The rich console summary and the progress bar."""

from __future__ import annotations

import dataclasses
import io
import os

from rich.console import Console
from test_report_samples import (
    BACKWARD_NAME,
    CULPRIT_MODULE,
    CULPRIT_STACK,
    EXTRA_NAME,
    GROUP_HINT,
    sample_comparison,
)

from pi0align.report.comparison.console import print_summary, progress_bar


def render(comparison, width: int = 220, **options) -> str:
    console = Console(file=io.StringIO(), width=width, color_system=None)
    print_summary(comparison, console, **options)
    return console.file.getvalue()


def test_diverged_summary_names_the_culprit_where_to_look_and_the_evidence():
    text = render(sample_comparison())
    assert "DIVERGED" in text
    assert "pairs matched 64 · only in A 0 · only in B 1" in text
    assert "21 fail" in text
    first_divergence = text[text.index("first divergence"):text.index("first divergence in backward")]
    assert CULPRIT_MODULE in first_divergence and "Functional.gelu" in first_divergence
    # innermost frame first: the line to open
    assert first_divergence.index(CULPRIT_STACK[-1]) < first_divergence.index(CULPRIT_STACK[0])
    lines = text.splitlines()
    culprit_at = [i for i, line in enumerate(lines) if CULPRIT_MODULE in line and "1e+05" in line]
    assert len(culprit_at) == 1 and "Functional.gelu" in lines[culprit_at[0]]
    assert CULPRIT_STACK[-1] in lines[culprit_at[0] + 1]
    assert BACKWARD_NAME in text[text.index("first divergence in backward"):text.index("top culprits")]
    assert EXTRA_NAME in text  # the record on one side only is listed, not just counted
    manifest_line = next(line for line in text.splitlines() if "torch_npu" in line)
    assert "null" in manifest_line and "2.5.1" in manifest_line  # absent on one side: null, as in the JSON
    assert "installed on one side" not in manifest_line  # the table's lines carry the status, not the why
    assert "note: sample note" in text


def test_the_culprit_table_reads_at_80_columns_with_call_sites_relative_to_the_working_folder():
    comparison = sample_comparison()
    here = os.path.join(os.getcwd(), "pi0align", "pi0", "policy.py:57 forward")
    deep = "model.paligemma_with_expert.gemma_expert.model.layers.1.mlp.gate_proj"
    comparison.culprits[1] = dataclasses.replace(comparison.culprits[1], module=deep, stack=[here],
                                                 name=f"{deep}/Functional.linear#0", kind="call")
    text = render(comparison, width=80)
    table = text[text.index("top culprits"):text.index("culprit groups")].splitlines()
    assert all(len(line) <= 80 for line in table), table
    at = next(i for i, line in enumerate(table) if "gate_proj" in line)
    call, module, site = table[at - 1], table[at], table[at + 1]
    assert call.rstrip().endswith(" Functional.linear#0")  # the call, then its module on a line of its own
    assert module.strip() == "…model.layers.1.mlp.gate_proj"  # whole parts lost from its start
    assert site.strip() == "pi0align/pi0/policy.py:57 forward"
    culprit = next(line for line in table if CULPRIT_MODULE in line)
    assert culprit.split()[:5] == ["1", "0", "call", "fwd", "intrinsic"]


def test_culprit_groups_and_their_hints_are_listed():
    text = render(sample_comparison())
    groups = text[text.index("culprit groups"):]
    assert "Functional.gelu" in groups and "matmul family" in groups and "12%" in groups
    assert f"hint (matmul family): {GROUP_HINT}" in " ".join(groups.split())


def test_top_limits_the_culprits_shown():
    text = render(sample_comparison(), top=1)
    assert "top culprits (1 of 2)" in text
    assert "model.layers.3.mlp" not in text.split("top culprits")[1].split("records on one side")[0]


def test_aligned_summary_has_no_divergence_or_culprits():
    text = render(sample_comparison(diverged=False))
    assert "ALIGNED" in text and "DIVERGED" not in text
    assert "first divergence" not in text and "culprits" not in text


def test_progress_bar_draws_on_a_terminal_and_stays_silent_in_a_pipe():
    terminal = Console(file=io.StringIO(), force_terminal=True, width=100)
    with progress_bar(terminal, "comparing") as progress:
        progress(3, 10)
        progress(10, 10, "comparing step 2")
    assert "comparing step 2" in terminal.file.getvalue()

    pipe = Console(file=io.StringIO(), force_terminal=False)
    with progress_bar(pipe) as progress:
        progress(1, 2)
    assert pipe.file.getvalue() == ""
