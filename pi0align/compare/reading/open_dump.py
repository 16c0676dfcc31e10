"""Open a run given as a dump file, a run folder (one file per rank) or an msprobe dump folder.

Our reader (read_ours.py) is imported once a run holds our files: h5py, which it needs, takes a
tenth of the time of a compare of msprobe's dumps, which are JSON."""

from __future__ import annotations

import re
from pathlib import Path

from pi0align.compare.reading import read_msprobe
from pi0align.compare.reading.records import Dump
from pi0align.errors import UserError

MONITOR_NAME = re.compile(r"monitor(-rank\d+)?\.h5")  # dump/monitor_file.monitor_path's names
# An HDF5 file's first bytes (our files have no user block, which would move them to byte 512 or later)
HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


def open_run(path: str | Path, steps: set[int] | None = None, ranks: set[int] | None = None) -> dict[int, Dump]:
    """{rank: Dump} for every rank found at `path` (of `ranks`, when given), holding the records of
    `steps` (all when None)."""
    files, path = _locate(Path(path))
    if files is None:
        return read_msprobe.read_msprobe(path, steps, ranks)
    from pi0align.compare.reading import read_ours

    if ranks is not None:
        files = [file for file in files if read_ours.rank_of(file) in ranks]
    dumps = [read_ours.read_pi0align(file, steps) for file in files]
    try:
        return _by_rank([(dump.rank, file, dump) for file, dump in zip(files, dumps)], path)
    except UserError:
        for dump in dumps:
            dump.close()
        raise


def dumped_steps(path: str | Path) -> dict[int, dict[int, int | None]]:
    """{rank: {step: its number of records, None where not known without reading them}} of the
    steps held at `path`, complete or not, without reading their records."""
    files, path = _locate(Path(path))
    if files is None:
        return read_msprobe.dumped_steps(path)
    from pi0align.compare.reading import read_ours

    return _by_rank([(rank, file, steps) for file in files for rank, steps in [read_ours.dumped_steps(file)]], path)


def _locate(path: Path) -> tuple[list[Path] | None, Path]:
    """(the pi0align dump files at `path`, or None for an msprobe dump, and the path)."""
    if not path.exists():
        raise UserError(f"{path}: no such file or folder")
    if is_hdf5(path):
        return [path], path
    if path.is_dir():  # the run's monitor beside its dump is no dump
        files = sorted(p for p in path.glob("*.h5") if is_hdf5(p) and not MONITOR_NAME.fullmatch(p.name))
        if files:
            return files, path
    if read_msprobe.is_msprobe_path(path):
        return None, path
    if path.is_file():
        raise UserError(f"{path}: not a dump (neither a pi0align HDF5 file nor an msprobe dump.json)")
    raise UserError(f"{path}: no dump inside (expected *.h5 files or msprobe step*/rank*/dump.json)")


def is_hdf5(path: Path) -> bool:
    """Whether `path` is an HDF5 file: the reader then says whether it is one of ours."""
    if not path.is_file():  # a folder, or a pipe (which opening would wait on)
        return False
    try:
        with path.open("rb") as file:
            return file.read(len(HDF5_SIGNATURE)) == HDF5_SIGNATURE
    except OSError:  # unreadable: said when read
        return False


def _by_rank(items: list[tuple[int, Path, object]], folder: Path) -> dict:
    """{rank: item} of (rank, file, item) triples, refusing two files of one rank."""
    result, file_of = {}, {}
    for rank, file, item in items:
        if rank in result:
            raise UserError(f"{folder}: two files claim rank {rank} ({file_of[rank].name}, {file.name})")
        result[rank], file_of[rank] = item, file
    return result
