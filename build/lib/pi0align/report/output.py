"""Opening a report file for writing: create its folder, turn OS errors into one-line user errors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pi0align.errors import UserError


@contextmanager
def output_path(path: str | Path) -> Iterator[Path]:
    """Yield `path` with its folder created; any OSError while writing it becomes a UserError."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"cannot write {path}: it is a folder, give a file name")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        yield path
    except OSError as error:
        raise UserError(f"cannot write {path}: {error.strerror or error}") from None


def write_json_data(data: object, path: str | Path) -> Path:
    """Strict JSON (no NaN: make it json-safe first), indented, to `path`."""
    with output_path(path) as path:
        path.write_text(json.dumps(data, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    return path
