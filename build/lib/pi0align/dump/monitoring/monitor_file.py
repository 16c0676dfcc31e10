"""The monitor file's format (docs/monitor-format.md), and its writing: one HDF5 file per rank,
`monitor.h5` (`monitor-rank<R>.h5` on several processes), one row per training step of every
monitored module's quantities. Created once, then appended to at each step's end by the writer
process, each append all or nothing (journal.py): a killed run leaves every finished step. The
reader (compare/reading/read_monitor.py) and the test factory import this module; it imports
neither torch nor the rest of pi0align but the journal.
"""

from __future__ import annotations

import os
from pathlib import Path

import h5py
import numpy as np

from pi0align.dump.file_format import STR
from pi0align.dump.writing import journal
from pi0align.dump.writing.dump_file import ensure_room

FORMAT = "pi0align-monitor"
VERSION = 1
# Per module and step: its output's L2 norm and largest magnitude, and the NaN/Inf elements it holds
# (counted where its norm is not finite); its parameters' gradients' norm (after the backward and
# its all-reduce, before clipping) and their NaN/Inf elements; its parameters' norm after the step;
# the norm of the step's update of them (Adam's: lr × m̂ / (√v̂ + ε), from the states after it;
# NaN for other optimizers); the norms of Adam's first and second moments. NaN where a module has
# none (no parameter, an output not seen).
QUANTITIES = ("output_norm", "output_max", "output_nonfinite", "grad_norm", "grad_nonfinite", "param_norm",
              "update_norm", "exp_avg_norm", "exp_avg_sq_norm")
# the part of a step that computes each: the forward (0), the backward (1), the optimizer's step (2)
PHASES = {"output_norm": 0, "output_max": 0, "output_nonfinite": 0, "grad_norm": 1, "grad_nonfinite": 1,
          "param_norm": 2, "update_norm": 2, "exp_avg_norm": 2, "exp_avg_sq_norm": 2}
ROWS_PER_CHUNK = 64  # steps per chunk of `values`: a chunk written a few times, then left alone


def computed_order(module: int, quantity: str) -> tuple[int, int]:
    """When a step computes the quantity of the `module`-th module of the file (the order they
    ran), as a sort key: its phase, then its place there (the backward makes the last module's
    gradients first)."""
    phase = PHASES[quantity]
    return phase, -module if phase == 1 else module


def monitor_path(folder: Path, rank: int, world_size: int) -> Path:
    """Where a rank's monitor goes in a run folder."""
    return folder / ("monitor.h5" if world_size == 1 else f"monitor-rank{rank}.h5")


def create(path: Path, modules: list[str], attrs: dict) -> None:
    """A new monitor file (replacing any earlier one, whole: written aside, then renamed): its
    modules in the order they run, the quantities, and no step yet."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    with h5py.File(partial, "w") as f:
        f.attrs.update({"format": FORMAT, "version": VERSION, **attrs})
        f.create_dataset("modules", data=np.array(modules, dtype=object), dtype=STR)
        f.create_dataset("quantities", data=np.array(QUANTITIES, dtype=object), dtype=STR)
        f.create_dataset("steps", shape=(0,), maxshape=(None,), dtype=np.int64, chunks=(1024,))
        f.create_dataset("values", shape=(0, len(modules), len(QUANTITIES)), maxshape=(None, len(modules),
                         len(QUANTITIES)), dtype=np.float32, chunks=(ROWS_PER_CHUNK, len(modules), len(QUANTITIES)))
    journal.journal_path(path).unlink(missing_ok=True)  # an earlier file's: it must not undo this one
    os.replace(partial, path)


def append(path: Path, step: int, values: np.ndarray) -> None:
    """One step's row (modules × quantities), all of it or, when the process is killed first, none."""
    with journal.appending(path) as file, h5py.File(file, "a") as f:
        rows = f["values"]
        ensure_room(file.fileno(), 4 * rows.shape[1] * rows.shape[2] * ROWS_PER_CHUNK + (1 << 16))
        at = rows.shape[0]
        rows.resize(at + 1, axis=0)
        rows[at] = values.reshape(rows.shape[1:])
        f["steps"].resize((at + 1,))
        f["steps"][at] = step
        f.flush()
