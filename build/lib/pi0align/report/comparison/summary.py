"""The headline of a Comparison as JSON-ready data: what `--json` writes and the HTML report shows.

One function builds it so that the JSON file and the HTML page can never disagree.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pi0align.compare.result import CallRef, Comparison
from pi0align.report.json_values import JSON_SCHEMA_VERSION, call_dict, json_safe
from pi0align.runs.envdiff import env_diff_of


def optional_call_dict(call: CallRef | None) -> dict[str, Any] | None:
    return None if call is None else call_dict(call)


def summary(comparison: Comparison) -> dict[str, Any]:
    """Everything of `comparison` except its rows and metrics, JSON-ready (see docs/compare-json.md)."""
    return {
        "schema_version": JSON_SCHEMA_VERSION,
        "verdict": comparison.verdict,
        "noise_model": comparison.noise_model,
        "rows_over_dtype_limits": comparison.rows_over_dtype_limits,
        "source_a": comparison.source_a,
        "source_b": comparison.source_b,
        "coverage": json_safe(comparison.coverage),
        "row_verdicts": verdict_counts(comparison),
        "explained_by": dict(comparison.explained),
        "rank_verdicts": {str(rank): verdict for rank, verdict in comparison.rank_verdicts.items()},
        "first_divergence": optional_call_dict(comparison.first_divergence),
        "first_divergence_backward": optional_call_dict(comparison.first_divergence_backward),
        "culprits": [call_dict(culprit) for culprit in comparison.culprits],
        "culprit_groups": [json_safe(dataclasses.asdict(group)) for group in comparison.culprit_groups],
        "thresholds": json_safe(comparison.thresholds),
        "manifest_diff": [{"key": key, "a": json_safe(a), "b": json_safe(b)} for key, a, b in comparison.manifest_diff],
        "set_up": [json_safe(dataclasses.asdict(line)) for line in env_diff_of(comparison.manifest_diff).differing],
        "notes": list(comparison.notes),
    }


def verdict_counts(comparison: Comparison) -> dict[str, int]:
    """How many rows passed, warned, failed or could not be judged."""
    counts = dict.fromkeys(("pass", "warn", "fail", "n/a"), 0)
    for part in comparison.row_parts(["verdict"]):
        for verdict in counts:
            counts[verdict] += int((part["verdict"] == verdict).sum())
    return counts
