"""Every direction a reader gives a call and every kind of culprit prints in every report: the
console, the HTML page, the CSV and the JSON (a culprit of a direction the console had no word for
once ended `compare` in a traceback)."""

from __future__ import annotations

import csv
import dataclasses
import io
import json

import pytest
from rich.console import Console
from test_report_samples import sample_comparison

from pi0align.compare.reading.records import DIRECTIONS
from pi0align.compare.result import KINDS, Culprit, CulpritGroup
from pi0align.report.comparison.console import print_summary
from pi0align.report.comparison.csv_json import write_csv, write_json
from pi0align.report.comparison.html import write_html

CASES = [(direction, kind) for direction in DIRECTIONS for kind in KINDS]


def _comparison(direction: str, kind: str):
    comparison = sample_comparison()
    name = f"model.layers.1/Tensor.add_#{DIRECTIONS.index(direction)}"
    culprit = Culprit(step=0, name=name, module="model.layers.1", api="Tensor.add_", direction=direction,
                      kind=kind, stack=["train.py:9 step"], introduced_error=40.0, input_error=1e-7,
                      output_error=4e-6, evidence="intrinsic", bound=1e-7, bound_by="rounding")
    comparison.culprits = [culprit, *comparison.culprits]
    comparison.first_divergence = dataclasses.replace(comparison.first_divergence, direction=direction, kind=kind,
                                                      name=name)
    comparison.culprit_groups = [CulpritGroup(kind=kind, api="Tensor.add_", count=1, calls=3, share_introducing=0.3,
                                              median_ratio=40.0, median_output_error=4e-6, examples=[name]),
                                 *comparison.culprit_groups]
    comparison.rows.loc[0, "direction"] = direction
    return comparison, name


@pytest.mark.parametrize(("direction", "kind"), CASES)
def test_every_direction_and_kind_prints_in_every_report(tmp_path, direction, kind):
    comparison, name = _comparison(direction, kind)
    console = Console(file=io.StringIO(), width=80, color_system=None)
    print_summary(comparison, console)
    text = console.file.getvalue()
    table = text[text.index("top culprits"):text.index("culprit groups")]
    assert "Tensor.add_#" in table and kind in table
    if kind == "call":
        assert "call " in table  # with the direction, shortened or whole

    report = json.loads(write_json(comparison, tmp_path / "c.json").read_text())
    assert (report["culprits"][0]["direction"], report["culprits"][0]["kind"]) == (direction, kind)
    assert report["first_divergence"]["kind"] == kind
    with open(write_csv(comparison, tmp_path / "c.csv"), newline="") as rows:
        assert next(csv.DictReader(rows))["direction"] == direction
    page = write_html(comparison, tmp_path / "c.html").read_text()
    assert name in page and f">{kind}<" in page and f">{direction}<" in page
