"""Reader of monitor files (docs/monitor-format.md; their format: dump/monitoring/monitor_file.py): one rank's
every monitored module's quantities at every step, checked as dumps are (sizes against what the file
holds; a journal rolled back) before anything is read."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from pi0align.compare.reading.read_ours import with_file
from pi0align.compare.reading.sizes import check_length, check_stored
from pi0align.dump.monitoring.monitor_file import FORMAT, QUANTITIES, VERSION, computed_order

__all__ = ["Monitored", "computed_order", "read_monitor"]  # computed_order: the format's, for the readers
from pi0align.errors import UserError


@dataclass(frozen=True)
class Monitored:
    """One rank's monitor: `values[i, m, q]` is module `modules[m]`'s quantity `quantities[q]` at
    step `steps[i]` (NaN where the module has none)."""

    source: str
    rank: int
    modules: tuple[str, ...]
    quantities: tuple[str, ...]
    steps: np.ndarray
    values: np.ndarray


def read_monitor(path: str | Path) -> Monitored:
    """A monitor file, whole; bad input: one UserError line naming it."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such monitor file")
    return with_file(path, lambda f: _read(f, path), what="monitor file")


def _read(f: h5py.File, path: Path) -> Monitored:
    fmt = f.attrs.get("format", "")
    fmt = fmt.decode() if isinstance(fmt, bytes) else str(fmt)
    if fmt != FORMAT:
        raise UserError(f"{path}: not a monitor file (format {fmt!r}, expected {FORMAT!r})")
    if int(f.attrs.get("version", 0)) > VERSION:
        raise UserError(f"{path}: monitor format version {int(f.attrs['version'])} is newer than this pi0align reads")
    names = {}
    for name in ("modules", "quantities", "steps"):
        dataset = f[name]
        if dataset.ndim != 1:
            raise UserError(f"{path}: {name}: damaged (a column of shape {list(dataset.shape)})")
        check_stored(dataset, f"{path}: {name}")
        names[name] = dataset
    values = f["values"]
    shape = (len(names["steps"]), len(names["modules"]), len(names["quantities"]))
    if values.shape != shape:
        raise UserError(f"{path}: values: damaged (shape {list(values.shape)} for {list(shape)} steps × modules × "
                        "quantities)")
    check_stored(values, f"{path}: values")
    check_length(names["steps"], shape[0], f"{path}: steps")
    quantities = tuple(names["quantities"].asstr()[()].tolist())
    unknown = sorted(set(quantities) - set(QUANTITIES))
    if unknown:
        raise UserError(f"{path}: quantities: damaged (unknown {', '.join(map(repr, unknown[:3]))})")
    return Monitored(source=str(path), rank=int(f.attrs.get("rank", 0)),
                     modules=tuple(names["modules"].asstr()[()].tolist()), quantities=quantities,
                     steps=names["steps"][()].astype(np.int64), values=values[()].astype(np.float64))
