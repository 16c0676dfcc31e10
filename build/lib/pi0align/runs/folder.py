"""A run as data: what `pi0align run` leaves in its folder (manifest.json, train_log.jsonl,
summary.json), the manifest a dump carries, or what another tool's log or LeRobot's training
config holds (runs/logs/). Torch-free; every bad input is one UserError line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pi0align.errors import UserError
from pi0align.runs.logs import DEFAULT_LOG_OPTIONS, LogOptions, is_lerobot_config, lerobot_manifest, read_log

MANIFEST, LOG, SUMMARY = "manifest.json", "train_log.jsonl", "summary.json"
CONSOLE_LOG = "console.log"  # the command's output `pi0align attach` keeps: the script's own log
LEROBOT_CONFIG = "train_config.json"
_MAX_JSON = 64 * 2**20  # a manifest or a training config: kilobytes
_WHERE_LEROBOT_CONFIG = (LEROBOT_CONFIG, f"pretrained_model/{LEROBOT_CONFIG}",
                         f"checkpoints/last/pretrained_model/{LEROBOT_CONFIG}")


@dataclass(frozen=True)
class Run:
    """One run: its name (the folder's or the file's), where it lies, its manifest, its per-step
    log and its summary (empty where none is known), and what it was read from (`kind`)."""

    name: str
    path: Path
    manifest: dict[str, Any]
    log: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    kind: str = "pi0align run"


def read_run(path: str | Path, *, need_log: bool = False, options: LogOptions = DEFAULT_LOG_OPTIONS) -> Run:
    """A run folder, a manifest file, a dump (file, run folder of dumps, or msprobe folder: its
    manifest, through compare's readers), another tool's log (runs/logs/: read as `options` say)
    or LeRobot's training config (a `train_config.json`, a checkpoint or output folder holding one).
    `need_log`: the run's per-step log is read, and must be there (left unread otherwise)."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: no such run folder or file")
    if path.is_dir() and ((path / MANIFEST).is_file() or (path / LOG).is_file()):
        log = _log(path / LOG) if need_log and (path / LOG).is_file() else []
        if need_log and not log and (path / CONSOLE_LOG).is_file():  # attached to a model whose output has no loss
            script_log = read_log(path / CONSOLE_LOG, options)
            log = script_log.records if script_log is not None else []
        if need_log and not log:
            raise UserError(f"{path}: no {LOG} with a step in it (a run folder of `pi0align run`)")
        return Run(name=path.name, path=path, log=log,
                   manifest=_json_object(path / MANIFEST) if (path / MANIFEST).is_file() else {},
                   summary=_json_object(path / SUMMARY) if (path / SUMMARY).is_file() else {})
    single = _single_json_object(path) if path.is_file() else None
    if single is not None and not ("step" in single and "loss" in single):
        if need_log:
            raise UserError(f"{path}: a JSON object, not a log of steps")
        manifest = lerobot_manifest(single) if is_lerobot_config(single) else single
        return Run(name=path.parent.name, path=path.parent, manifest=manifest,
                   kind="LeRobot training config" if is_lerobot_config(single) else "manifest")
    config = next((path / where for where in _WHERE_LEROBOT_CONFIG if path.is_dir()
                   and (path / where).is_file()), None)
    if config is not None and not need_log:
        return read_run(config)
    log = read_log(path, options) if need_log or path.is_file() else None  # a folder of events has no set-up
    if log is not None:
        return Run(name=path.stem if path.is_file() else path.name, path=path, manifest=log.manifest,
                   log=log.records, summary=log.summary, kind=log.kind)
    if need_log:
        raise UserError(f"{path}: not a run folder of `pi0align run` nor a log pi0align reads (LeRobot's console "
                        f"log, TensorBoard events, CSV or JSON lines of steps and losses)"
                        + (": LeRobot's output folder holds no log, give its console log" if config else ""))
    if path.suffix == ".json":
        _json_object(path)  # says why the JSON is not a manifest
    return Run(name=path.stem if path.is_file() else path.name, path=path, manifest=_dump_manifest(path),
               kind="dump")


def _single_json_object(path: Path) -> dict[str, Any] | None:
    """The file's content when it is one JSON object (a manifest, a training config), else None."""
    try:
        if path.stat().st_size > _MAX_JSON:
            return None
        with path.open("rb") as handle:
            if not handle.read(64).lstrip().startswith(b"{"):
                return None
        value = json.loads(path.read_bytes())
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


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
