"""Open a run given as a dump file, a run folder (one file per rank) or an msprobe dump folder.

Our reader (read_ours.py) is imported once a run holds our files: h5py, which it needs, takes a
tenth of the time of a compare of msprobe's dumps, which are JSON."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pi0align.compare.reading import read_msprobe
from pi0align.compare.reading.records import Dump
from pi0align.errors import UserError

MONITOR_NAME = re.compile(r"monitor(-rank\d+)?\.h5")  # dump/monitor_file.monitor_path's names
# An HDF5 file's first bytes (our files have no user block, which would move them to byte 512 or later)
HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


@dataclass(frozen=True)
class Run:
    """A run located once: its dump files by rank (ours; None for an msprobe dump), or each rank's
    step folders (msprobe's; None for ours), and the steps each rank holds, complete or not, with
    their numbers of records (None where not known without reading them). A compare hands it to
    every window and worker, which open it at their steps."""

    path: Path
    files: Mapping[int, Path] | None
    msprobe_folders: Mapping[int, tuple[tuple[int, Path], ...]] | None
    held: Mapping[int, Mapping[int, int | None]]

    @property
    def ranks(self) -> list[int]:
        return sorted(self.held)

    def steps(self) -> set[int]:
        """The steps any rank holds."""
        return set().union(*self.held.values()) if self.held else set()

    def wanted(self, steps: set[int] | None) -> Run:
        """This run holding only those of `steps` it holds (all when None)."""
        if steps is None:
            return self
        return Run(self.path, self.files, self.msprobe_folders,
                   {rank: {step: count for step, count in held.items() if step in steps}
                    for rank, held in self.held.items()})

    def open(self, steps: set[int] | None = None, ranks: set[int] | None = None) -> dict[int, Dump]:
        """{rank: Dump} of every rank (of `ranks`, when given), holding the records of `steps` (all
        when None)."""
        if self.msprobe_folders is not None:
            return read_msprobe.read_msprobe(self.path, {rank: folders for rank, folders in self.msprobe_folders.items()
                                                         if ranks is None or rank in ranks}, steps)
        from pi0align.compare.reading import read_ours

        opened: dict[int, Dump] = {}
        try:
            for rank, file in self.files.items():
                if ranks is None or rank in ranks:
                    opened[rank] = read_ours.read_pi0align(file, steps)
        except BaseException:
            close_run(opened)
            raise
        return opened


def locate_run(path: str | Path) -> Run:
    """The run at `path`: a dump file, a run folder of one file per rank, or an msprobe folder."""
    files, path = _locate(Path(path))
    if files is None:
        folders = read_msprobe.step_folders(path)
        steps = {rank: {step: None for step, _ in sorted(held)} for rank, held in folders.items()}
        return Run(path, None, folders, steps)
    from pi0align.compare.reading import read_ours

    held = [(file, *read_ours.dumped_steps(file)) for file in files]
    by_rank = _by_rank([(rank, file, (file, steps)) for file, rank, steps in held], path)
    return Run(path, {rank: file for rank, (file, _) in by_rank.items()}, None,
               {rank: steps for rank, (_, steps) in by_rank.items()})


def open_run(path: str | Path, steps: set[int] | None = None, ranks: set[int] | None = None) -> dict[int, Dump]:
    """{rank: Dump} for every rank found at `path` (of `ranks`, when given), holding the records of
    `steps` (all when None)."""
    return locate_run(path).open(steps, ranks)


def dumped_steps(path: str | Path) -> Mapping[int, Mapping[int, int | None]]:
    """{rank: {step: its number of records, None where not known without reading them}} of the
    steps held at `path`, complete or not, without reading their records."""
    return locate_run(path).held


def close_run(runs: dict[int, Dump]) -> None:
    for dump in runs.values():
        dump.close()


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
