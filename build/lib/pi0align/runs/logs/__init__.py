"""The logs runs already leave, read as runs beside pi0align's own folders: LeRobot's `lerobot-train`
console log (and the case study's logs that capture it, summary lines included) and pi0align's
recipe log (console.py), TensorBoard event files (tensorboard.py), CSV or JSON lines of steps and
losses (tables.py), and LeRobot's `train_config.json` (lerobot_config.py). Each is recognised by
its content, never its name (`read_log`), read in bounded memory, nothing in it evaluated.

Steps are pi0align's: step k is the (k+1)-th optimizer update (console.py converts LeRobot's
counts); TensorBoard, CSV and JSON-lines steps are taken as written.
"""

from __future__ import annotations

import json
from pathlib import Path

from pi0align.runs.logs.console import read_console_log
from pi0align.runs.logs.lerobot_config import is_lerobot_config, lerobot_manifest
from pi0align.runs.logs.records import DEFAULT_LOG_OPTIONS, Log, LogOptions, head
from pi0align.runs.logs.tables import csv_columns, read_csv, read_json_lines
from pi0align.runs.logs.tensorboard import is_event_file, read_tensorboard

__all__ = ["DEFAULT_LOG_OPTIONS", "Log", "LogOptions", "is_lerobot_config", "lerobot_manifest", "read_log"]


def read_log(path: Path, options: LogOptions = DEFAULT_LOG_OPTIONS) -> Log | None:
    """The log at `path` (a file, or a folder of TensorBoard event files), or None when it is no
    log this module knows (the caller says what it expected)."""
    if path.is_dir():
        events = sorted(p for p in path.rglob("*") if p.is_file() and is_event_file(p))
        return read_tensorboard(events, options) if events else None
    if is_event_file(path):
        return read_tensorboard([path], options)
    start = head(path)
    if b"\0" in start:
        return None
    first = next((line for line in start.decode("utf-8", "replace").splitlines() if line.strip()), "")
    if first.lstrip().startswith("{"):
        try:
            value = json.loads(first)
        except ValueError:
            value = None
        if isinstance(value, dict):
            return read_json_lines(path, options)
    console = read_console_log(path)
    if console is not None:
        return console
    if csv_columns(first, options) is not None:
        return read_csv(path, options)
    return None
