"""`--csv` and `--json` files: content, strict JSON, unwritable paths."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
from test_report_samples import BACKWARD_NAME, CULPRIT_NAME, CULPRIT_STACK, THRESHOLDS, sample_comparison

from pi0align.compare.result import ROW_COLUMNS
from pi0align.errors import UserError
from pi0align.report.comparison.csv_json import write_csv, write_json


def strict_json(path):
    def refuse(constant):
        raise AssertionError(f"non-standard JSON constant {constant}")
    return json.loads(path.read_text(), parse_constant=refuse)


def test_csv_holds_every_row_and_column(tmp_path):
    comparison = sample_comparison()
    path = write_csv(comparison, tmp_path / "out" / "rows.csv")
    table = pd.read_csv(path)
    assert list(table.columns) == ROW_COLUMNS
    assert len(table) == len(comparison.rows)
    culprit_output = table[(table["name"] == CULPRIT_NAME) & (table["step"] == 0) & (table["role"] == "output")]
    assert culprit_output["rel_l2_err"].tolist() == [1e-3]
    assert culprit_output["introduced_error"].tolist() == [pytest.approx(1e5)]
    only_b = table[table["pairing"] == "only_b"]
    assert len(only_b) == 1 and math.isnan(only_b["seq_a"].iloc[0]) and math.isnan(only_b["cosine"].iloc[0])


def test_json_summary_of_a_diverged_comparison(tmp_path):
    summary = strict_json(write_json(sample_comparison(), tmp_path / "summary.json"))
    assert summary["verdict"] == "diverged"
    assert summary["coverage"] == {"matched": 64, "only_a": 0, "only_b": 1}
    assert summary["first_divergence"] == {
        "step": 0, "name": CULPRIT_NAME, "module": "model.layers.2.mlp", "api": "Functional.gelu",
        "direction": "forward", "stack": CULPRIT_STACK, "rank": 0, "kind": "call",
    }
    assert summary["first_divergence_backward"]["name"] == BACKWARD_NAME
    culprits = summary["culprits"]
    assert [c["name"] for c in culprits] == [CULPRIT_NAME, "model.layers.3.mlp/Functional.linear#0"]
    assert culprits[0]["introduced_error"] == 1e5 and culprits[0]["metric"] == "rel_l2_err"
    assert set(culprits[0]) >= {"step", "name", "module", "api", "direction", "introduced_error", "stack"}
    assert culprits[0]["kind"] == "call"
    groups = summary["culprit_groups"]
    assert [(g["kind"], g["api"], g["count"]) for g in groups] == [("call", "Functional.gelu", 1),
                                                                    ("call", "matmul family", 1)]
    assert set(groups[1]) == {"kind", "api", "count", "calls", "share_introducing", "median_ratio",
                              "median_output_error", "hint", "examples"} and groups[1]["hint"]
    assert summary["thresholds"] == THRESHOLDS
    assert summary["manifest_diff"][1] == {"key": "versions.torch_npu", "a": None, "b": "2.5.1"}
    assert summary["row_verdicts"]["fail"] == 21


def test_json_summary_of_an_aligned_comparison_with_nan_thresholds(tmp_path):
    comparison = sample_comparison(diverged=False)
    comparison.thresholds = {"float32": {"rel_l2_err": 1e-5, "cosine": float("nan")}}
    summary = strict_json(write_json(comparison, tmp_path / "summary.json"))
    assert summary["verdict"] == "aligned"
    assert summary["first_divergence"] is None and summary["first_divergence_backward"] is None
    assert summary["culprits"] == []
    assert summary["thresholds"]["float32"]["cosine"] is None


def test_unwritable_outputs_are_one_line_user_errors(tmp_path):
    comparison = sample_comparison()
    (tmp_path / "a-file").write_text("")
    with pytest.raises(UserError, match="a-file"):
        write_json(comparison, tmp_path / "a-file" / "summary.json")
    with pytest.raises(UserError, match="folder"):
        write_csv(comparison, tmp_path)
