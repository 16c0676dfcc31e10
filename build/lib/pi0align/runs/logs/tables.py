"""Tables of steps and losses: CSV (`,`, `;` or tab) and JSON lines, their columns named or found
by the usual names; steps taken as written."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from pi0align.errors import UserError
from pi0align.runs.logs.records import Log, LogOptions, check_order, lines

STEP_COLUMNS = ("step", "steps", "global_step", "iteration", "iter")
LOSS_COLUMNS = ("loss", "train_loss", "train/loss")


def csv_columns(first: str, options: LogOptions) -> tuple[str, str] | None:
    """The step and loss columns a CSV header names (None: not such a header)."""
    names = [name.strip().strip('"') for name in re.split(r"[,;\t]", first)]
    if len(names) < 2:
        return None
    if options.columns:
        return options.columns if set(options.columns) <= set(names) else None
    step = next((name for name in STEP_COLUMNS if name in names), None)
    loss = next((name for name in LOSS_COLUMNS if name in names), None)
    return (step, loss) if step and loss else None


def _rows(path: Path, step_column: str, loss_column: str, rows) -> list[dict]:
    """Records of (step, loss) pairs: rows without both (another kind of line) are left out."""
    records = []
    for step, loss in rows:
        try:
            step_value, loss_value = float(step), float(loss)
        except (TypeError, ValueError):
            continue
        if math.isfinite(step_value) and step_value == int(step_value):
            records.append({"step": int(step_value), "loss": loss_value})
    if not records:
        raise UserError(f"{path}: no row with a whole `{step_column}` and a numeric `{loss_column}`")
    records.sort(key=lambda record: record["step"])
    check_order(path, records)
    return records


def read_csv(path: Path, options: LogOptions) -> Log:
    import pandas as pd

    first = next((line for line in lines(path) if line.strip()), "")
    step_column, loss_column = csv_columns(first, options)
    separator = next(s for s in (",", ";", "\t") if s in first)
    try:
        frame = pd.read_csv(path, sep=separator, usecols=[step_column, loss_column])
    except (ValueError, OSError, pd.errors.ParserError) as error:
        raise UserError(f"{path}: not a CSV of steps and losses ({str(error).splitlines()[0]})") from None
    rows = zip(frame[step_column], frame[loss_column])
    return Log(kind="CSV", records=_rows(path, step_column, loss_column, rows), summary={}, manifest={})


def read_json_lines(path: Path, options: LogOptions) -> Log:
    step_column, loss_column = options.columns or (None, None)
    pairs = []
    for line in lines(path):
        try:
            value = json.loads(line)
        except ValueError:
            continue  # a line cut short, or text around the records
        if not isinstance(value, dict):
            continue
        step_column = step_column or next((name for name in STEP_COLUMNS if name in value), None)
        loss_column = loss_column or next((name for name in LOSS_COLUMNS if name in value), None)
        pairs.append((value.get(step_column), value.get(loss_column)))
    if not (step_column and loss_column):
        raise UserError(f"{path}: JSON lines without a step and a loss (name them: --columns STEP,LOSS)")
    return Log(kind="JSON lines", records=_rows(path, step_column, loss_column, pairs), summary={}, manifest={})
