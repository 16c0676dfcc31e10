"""`pi0align curves --json`: each run's loss against the reference's and, with --modules, where
each module quantity leaves the band (docs/runs.md)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from pi0align.report.json_values import JSON_SCHEMA_VERSION, json_safe
from pi0align.report.output import write_json_data
from pi0align.runs.curves import CurveComparison
from pi0align.runs.monitor import Leaving, ModuleComparison


def curves_summary(comparison: CurveComparison, modules: ModuleComparison | None) -> dict:
    summary = {"schema_version": JSON_SCHEMA_VERSION, "reference": comparison.reference,
               "tolerance": comparison.tolerance, "smooth": comparison.smooth, "exact": comparison.exact,
               "runs": [json_safe(dataclasses.asdict(d)) for d in comparison.differences]}
    if modules is not None:
        summary["modules"] = {
            "band": modules.band, "order": modules.modules,
            "leaving": [json_safe(dataclasses.asdict(x)) for x in modules.leaving],
            "first_outside": {run: first_outside_point(first) for run, first in modules.first_outside.items()}}
    return summary


def first_outside_point(leaving: Leaving | None) -> dict | None:
    """Where a module quantity first leaves its band, as JSON: module, quantity, step."""
    return None if leaving is None else {"module": leaving.module, "quantity": leaving.quantity,
                                         "step": leaving.first_outside}


def write_curves_json(comparison: CurveComparison, modules: ModuleComparison | None, path: str | Path) -> Path:
    return write_json_data(curves_summary(comparison, modules), path)
