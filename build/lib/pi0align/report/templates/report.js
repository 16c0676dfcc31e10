"use strict";
// Draws the charts and the row table of a pi0align compare report. No network, no libraries but
// the inlined plotly.js. Rows come as columns (see pi0align/report/rowdata.py).
(function () {
  const readJson = (id) => JSON.parse(document.getElementById(id).textContent);

  // ---- charts
  const figures = readJson("figures-data");
  for (const element of document.querySelectorAll(".chart")) {
    const figure = figures[element.id.replace("chart-", "")];
    if (figure) Plotly.newPlot(element, figure.data, figure.layout, {responsive: true, displaylogo: false});
    else element.textContent = "no data for this chart";
  }

  // ---- table
  const payload = readJson("rows-data");
  const config = readJson("table-config");
  const PAGE_SIZE = 100;
  const TEXT_FILTER_COLUMNS = ["name", "module", "api", "stack", "role", "dtype_a", "dtype_b", "pairing"];
  const columns = Object.fromEntries(payload.columns.map((column) => [column.name, column]));
  const value = (column, row) => column.kind === "number" ? column.data[row] : column.values[column.codes[row]];
  const allRows = Array.from({length: payload.count}, (_, row) => row);
  let sorted = allRows;
  let shown = allRows;
  let page = 0;
  let sortState = {column: null, direction: 1};

  const table = document.getElementById("rows-table");
  const textInput = document.getElementById("filter-text");
  const selects = {};

  function formatValue(column, x) {
    if (column.kind === "text") return x;
    if (x === null) return "—";
    if (!Number.isFinite(x)) return x > 0 ? "inf" : "-inf";
    return Number.isInteger(x) ? String(x) : String(Number(x.toPrecision(3)));
  }

  // Numbers: missing values last whichever the direction; text: natural order ("layers.2" < "layers.10").
  function compareRows(column, direction) {
    const collator = new Intl.Collator(undefined, {numeric: true});
    return (a, b) => {
      const x = value(column, a), y = value(column, b);
      if (column.kind === "number") {
        if (x === null || y === null) return (x === null) - (y === null);
        return direction * (x - y || 0);
      }
      return direction * collator.compare(x, y);
    };
  }

  function sortBy(name) {
    const direction = sortState.column === name ? -sortState.direction : 1;
    sortState = {column: name, direction};
    sorted = allRows.slice().sort(compareRows(columns[name], direction));
    for (const th of table.tHead.rows[0].cells) {
      th.classList.toggle("asc", th.dataset.column === name && direction === 1);
      th.classList.toggle("desc", th.dataset.column === name && direction === -1);
    }
    applyFilters();
  }

  // A text column is stored once per distinct value: test the needle per value, then per row by code.
  function textMatches(needle) {
    const hits = TEXT_FILTER_COLUMNS.filter((name) => columns[name]).map((name) => {
      const column = columns[name];
      return [column, column.values.map((text) => text.toLowerCase().includes(needle))];
    });
    return (row) => hits.some(([column, hit]) => hit[column.codes[row]]);
  }

  function applyFilters() {
    const needle = textInput.value.trim().toLowerCase();
    const matchesText = needle ? textMatches(needle) : () => true;
    const chosen = Object.entries(selects).filter(([, select]) => select.value !== "")
      .map(([name, select]) => [columns[name], select.value]);
    shown = sorted.filter((row) => chosen.every(([column, wanted]) => String(value(column, row)) === wanted) && matchesText(row));
    page = 0;
    render();
  }

  function render() {
    const pages = Math.max(1, Math.ceil(shown.length / PAGE_SIZE));
    page = Math.min(Math.max(page, 0), pages - 1);
    const start = page * PAGE_SIZE;
    const body = document.createElement("tbody");
    for (const row of shown.slice(start, start + PAGE_SIZE)) {
      const tr = body.insertRow();
      tr.className = value(columns.verdict, row);
      for (const name of config.columns) {
        const column = columns[name];
        const td = tr.insertCell();
        td.textContent = formatValue(column, value(column, row));
        if (column.kind === "number") td.className = "num";
        if (name === "name" && columns.stack) td.title = value(columns.stack, row);
      }
    }
    table.replaceChild(body, table.tBodies[0]);
    const filtered = shown.length === payload.count ? "" : ` (filtered from ${payload.count})`;
    document.getElementById("page-info").textContent = shown.length
      ? `rows ${start + 1}–${Math.min(start + PAGE_SIZE, shown.length)} of ${shown.length}${filtered} · page ${page + 1}/${pages}`
      : `no rows match${filtered}`;
  }

  function buildHeader() {
    const tr = table.tHead.insertRow();
    for (const name of config.columns) {
      const th = document.createElement("th");
      th.textContent = name;
      th.dataset.column = name;
      th.title = "click to sort";
      th.addEventListener("click", () => sortBy(name));
      tr.appendChild(th);
    }
  }

  function buildSelects() {
    const container = document.getElementById("filter-selects");
    for (const name of config.selects) {
      const column = columns[name];
      const distinct = [...new Set(allRows.map((row) => value(column, row)))]
        .sort(column.kind === "number" ? (a, b) => a - b : undefined);
      const select = document.createElement("select");
      select.id = "filter-" + name;
      select.add(new Option(`${name}: all`, ""));
      for (const x of distinct) select.add(new Option(`${name}: ${formatValue(column, x)}`, String(x)));
      select.addEventListener("change", applyFilters);
      selects[name] = select;
      container.appendChild(select);
    }
  }

  // The culprit and first-divergence links show that call's rows.
  function showCall(link) {
    for (const select of Object.values(selects)) select.value = "";
    for (const name of ["step", "rank"]) if (selects[name]) selects[name].value = link.dataset[name];
    textInput.value = link.dataset.name;
    applyFilters();
  }

  buildHeader();
  buildSelects();
  textInput.addEventListener("input", applyFilters);
  document.getElementById("filter-reset").addEventListener("click", () => {
    textInput.value = "";
    for (const select of Object.values(selects)) select.value = "";
    applyFilters();
  });
  document.getElementById("page-prev").addEventListener("click", () => { page -= 1; render(); });
  document.getElementById("page-next").addEventListener("click", () => { page += 1; render(); });
  for (const link of document.querySelectorAll(".show-call")) link.addEventListener("click", () => showCall(link));
  render();
})();
