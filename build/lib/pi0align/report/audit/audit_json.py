"""`pi0align audit --json`: an audit as JSON-ready data (docs/audit.md), the shapes of compare's
JSON where they are the same things (culprits, culprit groups)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from pi0align.auditing import Audit
from pi0align.auditing.standards import FLOOR_UNITS
from pi0align.report.json_values import JSON_SCHEMA_VERSION, call_dict, json_safe
from pi0align.report.output import write_json_data


def audit_summary(result: Audit) -> dict[str, Any]:
    """Everything of the audit, JSON-ready: the NaN/Inf origins are the first of `culprits`."""
    return {
        "schema_version": JSON_SCHEMA_VERSION,
        "verdict": result.verdict,
        "source": result.source,
        "mode": result.mode,
        "culprits": [call_dict(culprit) for culprit in result.culprits],
        "culprit_groups": [json_safe(dataclasses.asdict(group)) for group in result.culprit_groups],
        "edges": [json_safe(dataclasses.asdict(edge)) for edge in result.edges],
        "replayed": result.replayed,
        "not_replayed": dict(result.not_replayed),
        "standards": {family: {"float32": floors[0], "half": floors[1]} for family, floors in FLOOR_UNITS.items()},
        "notes": list(result.notes),
    }


def write_audit_json(result: Audit, path: str | Path) -> Path:
    return write_json_data(audit_summary(result), path)
