"""Open a run given as a dump file, a run folder (one file per rank) or an msprobe dump folder."""

from __future__ import annotations

from pathlib import Path

from pi0align.compare.reading.read_msprobe import is_msprobe_path, read_msprobe
from pi0align.compare.reading.read_ours import is_pi0align_file, read_pi0align
from pi0align.compare.reading.records import Dump
from pi0align.errors import UserError


def open_run(path: str | Path, steps: set[int] | None = None) -> dict[int, Dump]:
    """{rank: Dump} for every rank found at `path`."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: no such file or folder")
    if is_pi0align_file(path):
        dump = read_pi0align(path, steps)
        return {dump.rank: dump}
    if path.is_dir():
        files = sorted(p for p in path.glob("*.h5") if is_pi0align_file(p))
        if files:
            return _by_rank([read_pi0align(p, steps) for p in files], path)
    if is_msprobe_path(path):
        return read_msprobe(path, steps)
    if path.is_file():
        raise UserError(f"{path}: not a dump (neither a pi0align HDF5 file nor an msprobe dump.json)")
    raise UserError(f"{path}: no dump inside (expected *.h5 files or msprobe step*/rank*/dump.json)")


def _by_rank(dumps: list[Dump], folder: Path) -> dict[int, Dump]:
    result: dict[int, Dump] = {}
    for dump in dumps:
        if dump.rank in result:
            for d in dumps:
                d.close()
            raise UserError(f"{folder}: two files claim rank {dump.rank} "
                            f"({Path(result[dump.rank].source).name}, {Path(dump.source).name})")
        result[dump.rank] = dump
    return result
