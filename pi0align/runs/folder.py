"""A run as data: what `pi0align run` leaves in its folder (manifest.json, train_log.jsonl,
summary.json), or the manifest a dump carries. Torch-free; every bad input is one UserError line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pi0align.errors import UserError

MANIFEST, LOG, SUMMARY = "manifest.json", "train_log.jsonl", "summary.json"


@dataclass(frozen=True)
class Run:
    """One run: its name (the folder's), where it lies, its manifest, its per-step log and its
    summary (empty where the folder holds none)."""

    name: str
    path: Path
    manifest: dict[str, Any]
    log: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)


def read_run(path: str | Path, *, need_log: bool = False) -> Run:
    """A run folder, a manifest file, or a dump (file, run folder of dumps, or msprobe folder: its
    manifest, through compare's readers). `need_log`: the run's per-step log is read, and must be
    there (left unread otherwise)."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: no such run folder or file")
    if path.is_file() and path.suffix == ".json":
        return Run(name=path.parent.name, path=path.parent, manifest=_json_object(path))
    if path.is_dir() and ((path / MANIFEST).is_file() or (path / LOG).is_file()):
        log = _log(path / LOG) if need_log and (path / LOG).is_file() else []
        if need_log and not log:
            raise UserError(f"{path}: no {LOG} with a step in it (a run folder of `pi0align run`)")
        return Run(name=path.name, path=path, log=log,
                   manifest=_json_object(path / MANIFEST) if (path / MANIFEST).is_file() else {},
                   summary=_json_object(path / SUMMARY) if (path / SUMMARY).is_file() else {})
    if need_log:
        raise UserError(f"{path}: not a run folder (no {LOG}: a folder `pi0align run` wrote)")
    return Run(name=path.stem if path.is_file() else path.name, path=path, manifest=_dump_manifest(path))


def _json_object(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except OSError as error:
        raise UserError(f"{path}: cannot read it ({error.strerror})") from None
    except (ValueError, UnicodeDecodeError) as error:
        raise UserError(f"{path}: not JSON ({error})") from None
    if not isinstance(value, dict):
        raise UserError(f"{path}: not a JSON object")
    return value


def _log(path: Path) -> list[dict[str, Any]]:
    """train_log.jsonl: one object per step; a last line cut short (a killed run) is left out."""
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise UserError(f"{path}: cannot read it ({error})") from None
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as error:
            if number == len(lines):  # written as the run was killed
                break
            raise UserError(f"{path}:{number}: not JSON ({error})") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int) or "loss" not in record:
            raise UserError(f"{path}:{number}: not a step record (an object with `step` and `loss`)")
        records.append(record)
    return records


def _dump_manifest(path: Path) -> dict[str, Any]:
    """The manifest of a dump's first rank (msprobe's dumps carry none: empty)."""
    from pi0align.compare.reading.open_dump import open_run

    runs = open_run(path)
    try:
        return dict(runs[min(runs)].manifest)
    finally:
        for dump in runs.values():
            dump.close()
