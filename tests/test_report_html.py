"""The HTML report: its row payload, its size, and (in headless Chromium, network blocked) that it
works by itself, shows the culprit, sorts, filters and pages."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from test_report_samples import BACKWARD_NAME, CULPRIT_MODULE, CULPRIT_NAME, EXTRA_NAME, GROUP_HINT, sample_comparison

from pi0align.compare.result import ROW_COLUMNS
from pi0align.compare.table import Table
from pi0align.report.comparison.html import default_html_path, write_html
from pi0align.report.comparison.rowdata import rows_json


def decode_rows(text: str) -> dict[str, list]:
    payload = json.loads(text)  # Python, like JSON.parse, reads 1e999 as inf
    columns = {}
    for column in payload["columns"]:
        if column["kind"] == "number":
            columns[column["name"]] = column["data"]
        else:
            columns[column["name"]] = [column["values"][code] for code in column["codes"]]
        assert len(columns[column["name"]]) == payload["count"]
    return columns


def test_row_payload_round_trips_numbers_missing_values_infinities_and_text():
    comparison = sample_comparison()
    rows = comparison.rows.copy()
    rows.loc[0, "max_rel_err"] = math.inf
    rows.loc[1, "name"] = "</script><b>x</b>"
    text = rows_json(Table.from_pandas(rows))
    assert "<" not in text  # cannot close the <script> element it is embedded in
    columns = decode_rows(text)
    assert list(columns)[:len(ROW_COLUMNS)] == ROW_COLUMNS
    assert columns["max_rel_err"][0] == math.inf
    assert columns["name"][1] == "</script><b>x</b>"
    assert columns["rel_l2_err"][:2] == [1e-8, 1e-8]
    extra = columns["name"].index(EXTRA_NAME)
    assert columns["seq_a"][extra] is None and columns["cosine"][extra] is None and columns["seq_b"][extra] == 1000
    assert columns["step"] == rows["step"].tolist()


def big_comparison(n_rows: int):
    """A comparison with about `n_rows` rows, errors of every magnitude, as real dumps give."""
    comparison = sample_comparison(n_steps=n_rows // 200, calls_per_step=100)
    rng = np.random.default_rng(0)
    for column in ("cosine", "max_abs_err", "max_rel_err", "mean_rel_err", "rel_l2_err", "rmse"):
        comparison.rows[column] = 10.0 ** rng.uniform(-9, 0, len(comparison.rows))
    return comparison


def test_html_for_20k_rows_stays_small(tmp_path):
    from plotly.offline import get_plotlyjs

    comparison = big_comparison(20_000)
    assert len(comparison.rows) > 20_000
    size = write_html(comparison, tmp_path / "big.html").stat().st_size
    # plotly.js (about 4.8 MB) plus under 250 bytes a row (table and chart): about 10 MB in all
    assert size - len(get_plotlyjs()) < 250 * len(comparison.rows)


def test_default_report_path_names_runs_by_their_folders():
    assert default_html_path("dumps/gpu/dump.h5", "dumps/npu/dump-rank0.h5") == Path("reports/gpu-vs-npu.html")
    assert default_html_path("runs/a.h5", "dumps/npu") == Path("reports/a-vs-npu.html")


# ---- in the browser


@pytest.fixture
def open_report(browser, tmp_path):
    """Open a report with every non-file request blocked; after the test, none may have been tried."""
    blocked, errors, contexts = [], [], []

    def open_(comparison, **options):
        path = write_html(comparison, tmp_path / "report.html", **options)
        context = browser.new_context(viewport={"width": 1400, "height": 1000})
        contexts.append(context)

        def route(request_route):
            if request_route.request.url.startswith("file:"):
                request_route.continue_()
            else:
                blocked.append(request_route.request.url)
                request_route.abort()

        context.route("**/*", route)
        page = context.new_page()
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
        page.goto(path.as_uri())
        page.wait_for_selector("#chart-errors .main-svg")
        return page

    yield open_
    for context in contexts:
        context.close()
    assert blocked == [], "the report asked the network for these"
    assert errors == []


def column_texts(page, column: str) -> list[str]:
    """The cells of one column on the current page of the row table, top to bottom."""
    return page.evaluate(
        """(column) => {
            const index = [...document.querySelectorAll('#rows-table thead th')]
                .findIndex(th => th.dataset.column === column);
            return [...document.querySelectorAll('#rows-table tbody tr')].map(row => row.cells[index].textContent);
        }""",
        column,
    )


def as_number(text: str) -> float:
    return math.nan if text == "—" else float(text)


@pytest.mark.browser
def test_report_works_offline_and_shows_verdict_culprit_and_charts(open_report):
    page = open_report(sample_comparison())
    assert page.inner_text("#verdict").lower() == "diverged"
    first_culprit = page.inner_text("#culprits tbody tr:first-child")
    assert CULPRIT_MODULE in first_culprit and "Functional.gelu" in first_culprit and "1e+05" in first_culprit
    assert CULPRIT_NAME in page.inner_text("#first-divergence")
    assert BACKWARD_NAME in page.inner_text("#first-divergence-backward")
    set_up = page.inner_text("#manifest")
    assert "torch_npu" in set_up and "installed on one side only" in set_up
    assert "call" in page.inner_text("#culprits tbody tr:first-child .kind")
    groups = page.inner_text("#culprit-groups")
    assert "matmul family" in groups and GROUP_HINT in groups
    # the module tree: the culprits' modules (layers 2 and 3) and every module above them hold a culprit
    culprit_paths = page.locator("#module-tree li.culprit > .module-name").all_inner_texts()
    assert culprit_paths == ["(model)", "model", "layers", "2", "mlp", "3", "mlp"]
    assert page.locator("#module-tree li.module").count() == 1 + 2 + 4 * 2  # (model), model, layers, 4 × (i, mlp)
    for chart in ("errors", "loss", "grad_norm"):
        assert page.locator(f"#chart-{chart} .main-svg").count() > 0
    assert page.locator("#chart-loss .scatterlayer .trace").count() == 2  # A and B
    assert "rows 1–65 of 65" in page.inner_text("#page-info")


@pytest.mark.browser
def test_table_sorts_by_a_column_both_ways(open_report):
    page = open_report(sample_comparison())
    header = page.locator("#rows-table th[data-column='introduced_error']")
    header.click()
    ascending = [as_number(text) for text in column_texts(page, "introduced_error")]
    numbers = [x for x in ascending if not math.isnan(x)]
    assert numbers == sorted(numbers) and all(math.isnan(x) for x in ascending[len(numbers):])  # missing last
    header.click()
    assert column_texts(page, "name")[0] == CULPRIT_NAME  # the largest introduced error
    descending = [as_number(text) for text in column_texts(page, "introduced_error")]
    assert descending[:len(numbers)] == sorted(numbers, reverse=True)
    page.locator("#rows-table th[data-column='name']").click()
    names = column_texts(page, "name")
    assert names == sorted(names, key=lambda name: name.replace("#", " "))  # natural order agrees here


@pytest.mark.browser
def test_table_filters_by_verdict_by_text_and_by_culprit_link(open_report):
    comparison = sample_comparison()
    page = open_report(comparison)
    page.select_option("#filter-verdict", "fail")
    verdicts = column_texts(page, "verdict")
    assert len(verdicts) == int((comparison.rows["verdict"] == "fail").sum()) and set(verdicts) == {"fail"}
    page.click("#filter-reset")
    page.fill("#filter-text", "contiguous")
    assert column_texts(page, "name") == [EXTRA_NAME] and column_texts(page, "pairing") == ["only_b"]
    page.click("#filter-reset")
    page.click("#culprits tbody tr:first-child a.show-call")
    assert set(column_texts(page, "name")) == {CULPRIT_NAME} and set(column_texts(page, "step")) == {"0"}
    assert column_texts(page, "role") == ["input", "output"]


@pytest.mark.browser
def test_table_pages_through_many_rows(open_report):
    page = open_report(big_comparison(1_000))
    assert page.inner_text("#page-info").startswith("rows 1–100 of 1001")
    assert len(column_texts(page, "name")) == 100
    page.click("#page-next")
    assert page.inner_text("#page-info").startswith("rows 101–200 of 1001")
    page.select_option("#filter-step", "4")
    assert page.inner_text("#page-info").startswith("rows 1–100 of 200 (filtered from 1001)")
    assert set(column_texts(page, "step")) == {"4"}


def test_error_chart_has_one_point_per_call_and_marks_the_culprit():
    from pi0align.report.comparison.charts import ZERO_FLOOR, error_by_step_figure

    comparison = sample_comparison()
    comparison.rows.loc[comparison.rows["step"] == 1, "rel_l2_err"] = 0.0  # exact agreement
    traces = {trace["name"]: trace for trace in error_by_step_figure(comparison, top=1)["data"]}
    assert traces["step 0"]["x"] == list(range(16))  # outputs only: inputs would repeat each x
    assert traces["step 0"]["y"][5] == 1e-3 and traces["step 0"]["y"][4] == 1e-8
    assert traces["step 1"]["y"] == [ZERO_FLOOR] * 16  # drawn on the log axis, not dropped
    assert traces["culprits"]["x"] == [5] and traces["culprits"]["y"] == [1e-3]
    assert CULPRIT_NAME in traces["culprits"]["text"][0]
