"""`pi0align bisect --json`: a bisect as JSON-ready data (docs/bisect.md)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from pi0align.bisecting import Bisection
from pi0align.bisecting.probes import probe_dict
from pi0align.report.bisect.bisect_console import probe_verdict
from pi0align.report.json_values import JSON_SCHEMA_VERSION, call_dict, json_safe
from pi0align.report.output import write_json_data
from pi0align.report.runs.curves_json import first_outside_point


def bisection_summary(result: Bisection) -> dict[str, Any]:
    return {
        "schema_version": JSON_SCHEMA_VERSION,
        "verdict": result.verdict,
        "reference": result.reference,
        "under_test": result.under_test,
        "parts_at": result.parts_at,
        "first_module": first_outside_point(result.first_module),
        "monitors": result.monitors,
        "searched": result.searched,
        "bound": json_safe(dataclasses.asdict(result.bound)),
        "probes": [{**probe_dict(probe), "verdict": probe_verdict(probe, result.bound)} for probe in result.probes],
        "first_checkpoint_beyond": result.first_checkpoint_beyond,
        "nondeterministic": result.nondeterministic,
        "culprit": None if result.culprit is None else call_dict(result.culprit),
        "judged_by": result.judged_by,
        "commands": list(result.commands),
        "notes": list(result.notes),
    }


def write_bisection_json(result: Bisection, path: str | Path) -> Path:
    return write_json_data(bisection_summary(result), path)
