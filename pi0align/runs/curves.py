"""Loss curves of runs side by side: a DataFrame of their logs, and how far each run's loss stays
from the first's (`pi0align curves`).

The acceptance line of a port is usually a mean relative loss error of at most 1 % against the
reference run; bitwise mode (`exact`) asks every step's loss to hold the same bits, as TorchTitan's
`loss_compare --assert-equal` does for two runs of one configuration.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from pi0align.runs.folder import Run, read_run

COLUMNS = ["run", "step", "loss", "grad_norm", "lr", "samples_per_s"]
TOLERANCE = 0.01  # relative loss error: the usual acceptance line of a port


def load_runs(paths: Iterable[str | Path]) -> pd.DataFrame:
    """The per-step logs of run folders, one row per run and step, the runs in the order given and
    each by step (COLUMNS; a metric a log lacks is NaN). Runs are named by their folder, made
    unique by their parent's name where two share one."""
    runs = [read_run(path, need_log=True) for path in paths]
    frames = [pd.DataFrame([{column: record.get(column, np.nan) for column in COLUMNS[1:]} for record in run.log])
              .assign(run=name).sort_values("step", kind="stable") for run, name in zip(runs, _names(runs))]
    frame = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=COLUMNS)
    return frame[COLUMNS].astype({"step": "int64"})


def _names(runs: list[Run]) -> list[str]:
    return run_names([run.path for run in runs], [run.name for run in runs])


def run_names(paths: list[Path], names: list[str] | None = None) -> list[str]:
    """How runs are named: by their folder (or `names`), made unique by its parent's name where two
    share one."""
    names = names or [path.name if path.is_dir() else path.parent.name for path in paths]
    return [f"{path.parent.name}/{name}" if names.count(name) > 1 else name for path, name in zip(paths, names)]


@dataclass(frozen=True)
class CurveDifference:
    """One run's loss against the reference's over their common steps (after smoothing both by a
    trailing mean of `smooth` steps): the first step outside the band (relative error above the
    tolerance; None when none is), the mean and largest relative error, whether every loss holds
    the same bits, and whether the run is within (`exact`: the same bits at every step of both)."""

    run: str
    steps: int
    first_outside: int | None
    mean_relative_error: float
    max_relative_error: float
    identical: bool
    within: bool

    def __bool__(self) -> bool:
        return self.within


@dataclass(frozen=True)
class CurveComparison:
    """Every run against the first (the reference): True when all are within."""

    reference: str
    tolerance: float
    smooth: int
    exact: bool
    differences: list[CurveDifference]

    def __bool__(self) -> bool:
        return all(self.differences)


def compare_curves(frame: pd.DataFrame, *, tolerance: float = TOLERANCE, smooth: int = 1,
                   exact: bool = False) -> CurveComparison:
    """Each run of `frame` (load_runs) against its first run: relative loss error per common step,
    |loss − loss_ref| / |loss_ref|, of both losses smoothed by a trailing mean of `smooth` steps."""
    runs = list(dict.fromkeys(frame["run"]))
    losses = {run: frame[frame["run"] == run].set_index("step")["loss"] for run in runs}
    reference = runs[0] if runs else ""
    differences = []
    for run in runs[1:]:
        ref, own = losses[reference], losses[run]
        common = ref.index.intersection(own.index)
        identical = bool(len(common)) and ref.index.equals(own.index) and bool(
            (ref.to_numpy().view(np.int64) == own.to_numpy().view(np.int64)).all())
        error = relative_error(ref, own, smooth)
        outside = error.index[error > tolerance]
        differences.append(CurveDifference(
            run=run, steps=len(common), first_outside=int(outside[0]) if len(outside) else None,
            mean_relative_error=float(error.mean()) if len(error) else float("nan"),
            max_relative_error=float(error.max()) if len(error) else float("nan"), identical=identical,
            within=identical if exact else (bool(len(common)) and not len(outside))))
    return CurveComparison(reference=reference, tolerance=tolerance, smooth=smooth, exact=exact,
                           differences=differences)


def relative_error(reference: pd.Series, other: pd.Series, smooth: int = 1) -> pd.Series:
    """|other − reference| / |reference| per step both hold (indexed by step), each smoothed first."""
    common = reference.index.intersection(other.index)
    ref = reference.loc[common].rolling(smooth, min_periods=1).mean()
    own = other.loc[common].rolling(smooth, min_periods=1).mean()
    with np.errstate(divide="ignore", invalid="ignore"):
        return (own - ref).abs() / ref.abs()
