"""What every log reader gives (`Log`), how it is asked to read (`LogOptions`), and the helpers the
readers share: a file's head and lines (read one at a time, in bounded memory), numbers, order."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pi0align.errors import UserError

HEAD = 4096  # bytes read to recognise a file's kind


@dataclass(frozen=True)
class LogOptions:
    """How a log of another tool is read."""

    loss_tag: str | None = None
    """TensorBoard: the loss's scalar tag (None: the first of tensorboard.LOSS_TAGS the file holds)."""
    columns: tuple[str, str] | None = None
    """CSV and JSON lines: the step and loss columns (None: the first of tables.STEP_COLUMNS and
    tables.LOSS_COLUMNS)."""


DEFAULT_LOG_OPTIONS = LogOptions()


@dataclass(frozen=True)
class Log:
    """What a log holds: its per-step records (`step`, `loss`, other metrics; `window` and
    `loss_resolution` where they are not 1 and 0), its summary and what it says of the run's
    set-up (as manifest keys), and what kind of log it was."""

    kind: str
    records: list[dict[str, Any]]
    summary: dict[str, Any]
    manifest: dict[str, Any]


def head(path: Path) -> bytes:
    try:
        with path.open("rb") as handle:
            return handle.read(HEAD)
    except OSError as error:
        raise UserError(f"{path}: cannot read it ({error.strerror})") from None


def lines(path: Path) -> Iterator[str]:
    """The file's lines, one at a time (a log may be large), undecodable bytes replaced."""
    try:
        with path.open(encoding="utf-8", errors="replace") as handle:
            yield from handle
    except OSError as error:
        raise UserError(f"{path}: cannot read it ({error.strerror})") from None


def parse_number(text: str, path: Path, number: int) -> float:
    try:
        return float(text)
    except ValueError:
        raise UserError(f"{path}:{number}: {text!r} is not a number") from None


def check_order(path: Path, records: list[dict]) -> None:
    if not records:
        raise UserError(f"{path}: no step line (LeRobot's `step:… loss:…`, pi0align's `step N loss X`)")
    for before, after in zip(records, records[1:]):
        if after["step"] <= before["step"]:
            raise UserError(f"{path}: step {after['step']} comes after step {before['step']}: two runs in one "
                            "log? (split it)")
