"""`pi0align curves --json`: each run's loss against the reference's and, with --modules, where
each module quantity leaves the band (docs/runs.md)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from pi0align.report.output import write_json_data
from pi0align.report.summary import JSON_SCHEMA_VERSION, json_safe
from pi0align.runs.curves import CurveComparison
from pi0align.runs.monitor import ModuleComparison


def curves_summary(comparison: CurveComparison, modules: ModuleComparison | None) -> dict:
    summary = {"schema_version": JSON_SCHEMA_VERSION, "reference": comparison.reference,
               "tolerance": comparison.tolerance, "smooth": comparison.smooth, "exact": comparison.exact,
               "runs": [json_safe(dataclasses.asdict(d)) for d in comparison.differences]}
    if modules is not None:
        summary["modules"] = {
            "band": modules.band, "order": modules.modules,
            "leaving": [json_safe(dataclasses.asdict(x)) for x in modules.leaving],
            "first_outside": {run: None if first is None else {"module": first.module, "quantity": first.quantity,
                                                               "step": first.first_outside}
                              for run, first in modules.first_outside.items()}}
    return summary


def write_curves_json(comparison: CurveComparison, modules: ModuleComparison | None, path: str | Path) -> Path:
    return write_json_data(curves_summary(comparison, modules), path)
