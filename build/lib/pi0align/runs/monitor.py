"""Two runs' module trends side by side (`pi0align curves A B --modules`): each module's monitored
quantities (docs/monitor-format.md) in each run, each run's relative difference to the first at
every step, against a band, and where each first leaves it. Torch-free.

Where to look first is the module and quantity that leave the band first, and among those that
leave at one step, the one whose quantity that step computed first: a forward output, in the order
the modules run; then a gradient, in the order the backward makes them (the last module first);
then what the optimizer's step made (the parameters, their update, Adam's moments).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from pi0align.compare.reading.read_monitor import computed_order
from pi0align.errors import UserError

COLUMNS = ["run", "step", "module", "quantity", "value"]
# A quantity's relative difference past this is outside the band. PI0 tiny and small trained 20
# steps on 1 and 2 threads stay within 1e-5 (every module, every quantity); a call 1 % off moves its
# block's output by about 1 %.
BAND = 1e-3


def monitor_files(run: str | Path) -> list[Path]:
    """A run folder's monitor files, rank 0's first; or a monitor file itself."""
    path = Path(run)
    if path.is_file():
        return [path]
    files = sorted(path.glob("monitor*.h5"), key=lambda p: (p.name != "monitor.h5", p.name))
    if not files:
        raise UserError(f"{path}: no monitor (monitor.h5): a run of `pi0align run` without --no-monitor, or a "
                        "loop with pi0align.Monitor")
    return files


def load_monitor(paths: Iterable[str | Path], *, missing_ok: bool = False) -> pd.DataFrame:
    """The monitors of runs (folders or monitor files; rank 0's), one row per run, step, module and
    quantity (COLUMNS), the runs in the order given, named as `curves` names them (`missing_ok`: a
    run without a monitor has no rows)."""
    from pi0align.compare.reading.open_dump import is_hdf5
    from pi0align.compare.reading.read_monitor import read_monitor
    from pi0align.runs.curves import run_names

    paths = [Path(p) for p in paths]
    frames = []
    for name, path in zip(run_names(paths), paths):
        if path.is_file() and not is_hdf5(path):
            if missing_ok:
                continue
            raise UserError(f"{path}: no monitor (not an HDF5 file: a log holds none; --modules compares the "
                            "folders of `pi0align run` and `pi0align attach`)")
        if missing_ok and not path.is_file() and not any(path.glob("monitor*.h5")):
            continue
        monitored = read_monitor(monitor_files(path)[0])
        steps, modules, quantities = np.meshgrid(monitored.steps, np.arange(len(monitored.modules)),
                                                 np.arange(len(monitored.quantities)), indexing="ij")
        frames.append(pd.DataFrame({
            "run": name, "step": steps.ravel(), "module": np.array(monitored.modules, object)[modules.ravel()],
            "quantity": np.array(monitored.quantities, object)[quantities.ravel()],
            "value": monitored.values.ravel()}))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=COLUMNS)


@dataclass(frozen=True)
class Leaving:
    """A module's quantity in a run: the first step its relative difference to the reference
    leaves the band (None: never), and its largest difference."""

    run: str
    module: str
    quantity: str
    first_outside: int | None
    max_difference: float


@dataclass(frozen=True)
class ModuleComparison:
    """Every run's module trends against the reference's (the first run): per module and quantity,
    where each leaves the band; `first_outside`, per run, the first to leave (where to look)."""

    reference: str
    band: float
    modules: list[str]  # in the order they run
    leaving: list[Leaving]
    first_outside: dict[str, Leaving | None]
    differences: pd.DataFrame  # run, step, module, quantity, difference

    def __bool__(self) -> bool:
        return all(first is None for first in self.first_outside.values())


def compare_modules(frame: pd.DataFrame, *, band: float = BAND) -> ModuleComparison:
    """Each run of `frame` (load_monitor) against its first: |value − reference| / |reference| per
    step both hold (0 where both are 0, both NaN or both the same infinity), against `band`."""
    runs = list(dict.fromkeys(frame["run"]))
    if len(runs) < 2:
        raise UserError("--modules compares runs: give two or more")
    reference = frame[frame["run"] == runs[0]].set_index(["step", "module", "quantity"])["value"]
    modules = list(dict.fromkeys(frame.loc[frame["run"] == runs[0], "module"]))
    position = {module: i for i, module in enumerate(modules)}
    leaving, first, parts = [], {}, []
    for run in runs[1:]:
        own = frame[frame["run"] == run].set_index(["step", "module", "quantity"])["value"]
        common = reference.index.intersection(own.index)
        a, b = reference.loc[common].to_numpy(), own.loc[common].to_numpy()
        with np.errstate(divide="ignore", invalid="ignore"):
            difference = np.where(a == b, 0.0, np.where(np.isnan(a) & np.isnan(b), 0.0, np.abs(b - a) / np.abs(a)))
        table = common.to_frame(index=False).assign(run=run, difference=difference)
        parts.append(table)
        outside = table[~(table["difference"] <= band)]  # NaN on one side only: outside
        earliest = outside.groupby(["module", "quantity"])["step"].min()
        largest = table.groupby(["module", "quantity"])["difference"].max()
        found = [Leaving(run, module, quantity, int(earliest[(module, quantity)]) if (module, quantity) in earliest
                         else None, float(largest[(module, quantity)])) for module, quantity in largest.index]
        leaving += found
        gone = [x for x in found if x.first_outside is not None]
        first[run] = min(gone, key=lambda x: computed_at(x, position), default=None)
    differences = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()
    return ModuleComparison(reference=runs[0], band=band, modules=modules, leaving=leaving, first_outside=first,
                            differences=differences)


def computed_at(leaving: Leaving, position: dict[str, int]) -> tuple:
    """When it was computed: its step, then monitor_file.computed_order."""
    return leaving.first_outside, *computed_order(position[leaving.module], leaving.quantity)
