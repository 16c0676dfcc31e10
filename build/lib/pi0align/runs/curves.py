"""Loss curves of runs side by side: a DataFrame of their logs, and how far each run's loss stays
from the first's (`pi0align curves`).

The acceptance line of a port is usually a mean relative loss error of at most 1 % against the
reference run; bitwise mode (`exact`) asks every step's loss to hold the same bits, as TorchTitan's
`loss_compare --assert-equal` does for two runs of one configuration. A log of means over windows
of steps (LeRobot's, every `log_freq` steps) is compared with a per-step run over the same windows,
never against single steps; a difference within the logs' printed rounding is not judged.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from pi0align.runs.folder import Run, read_run
from pi0align.runs.logs import DEFAULT_LOG_OPTIONS, LogOptions

COLUMNS = ["run", "step", "loss", "grad_norm", "lr", "samples_per_s", "window", "loss_resolution"]
_DEFAULTS = {"window": 1, "loss_resolution": 0.0}  # a per-step log printed in full
TOLERANCE = 0.01  # relative loss error: the usual acceptance line of a port


def load_runs(paths: Iterable[str | Path], options: LogOptions = DEFAULT_LOG_OPTIONS) -> pd.DataFrame:
    """The per-step logs of run folders or other tools' logs (read as `options` say), one row per
    run and logged step, the runs in the order given and each by step (COLUMNS; a metric a log lacks
    is NaN; `window`: the steps a row's values average, ending at its step). Runs are named by their
    folder or file, made unique by their parent's name where two share one."""
    runs = [read_run(path, need_log=True, options=options) for path in paths]
    frames = [log_frame(run.log).assign(run=name) for run, name in zip(runs, _names(runs))]
    frame = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=COLUMNS)
    return frame[COLUMNS].astype({"step": "int64", "window": "int64"})


def log_frame(records: list[dict[str, Any]]) -> pd.DataFrame:
    """One run's log records as rows of COLUMNS (but `run`), by step."""
    return pd.DataFrame([{column: record.get(column, _DEFAULTS.get(column, np.nan)) for column in COLUMNS[1:]}
                         for record in records], columns=COLUMNS[1:]).sort_values("step", kind="stable")


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
    trailing mean of `smooth` values): the first step outside the band (relative error above the
    tolerance, beyond the logs' printed rounding; None when none is), the mean and largest relative
    error, whether every loss holds the same bits, and whether the run is within (`exact`: the same
    bits at every step of both). `window`: the steps each compared loss averages (1: single steps;
    more where a log holds means, the per-step run then averaged over the log's windows, and a
    step is the window's last); `resolution`: the logs' printed rounding, absolute (0: in full)."""

    run: str
    steps: int
    first_outside: int | None
    mean_relative_error: float
    max_relative_error: float
    identical: bool
    within: bool
    window: int = 1
    resolution: float = 0.0

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
    """Each run of `frame` (load_runs) against its first run: relative loss error per common step
    (or window, aligned_losses), |loss − loss_ref| / |loss_ref|, of both losses smoothed by a
    trailing mean of `smooth` values."""
    runs = {run: own for run, own in frame.groupby("run", sort=False)}
    reference = next(iter(runs), "")
    differences = []
    for run in list(runs)[1:]:
        ref, own = runs[reference], runs[run]
        aligned = aligned_losses(ref, own)
        identical = bool(len(aligned)) and ref["step"].tolist() == own["step"].tolist() and bool(
            (ref["loss"].to_numpy().view(np.int64) == own["loss"].to_numpy().view(np.int64)).all())
        error = relative_error(aligned["reference"], aligned["other"], smooth)
        unseen = aligned["resolution"] / aligned["reference"].abs()  # what the logs' rounding hides
        outside = error.index[error > tolerance + unseen.fillna(0)]
        differences.append(CurveDifference(
            run=run, steps=len(aligned), first_outside=int(outside[0]) if len(outside) else None,
            mean_relative_error=float(error.mean()) if len(error) else float("nan"),
            max_relative_error=float(error.max()) if len(error) else float("nan"), identical=identical,
            within=identical if exact else (bool(len(aligned)) and not len(outside)),
            window=int(aligned["window"].max()) if len(aligned) else 1,
            resolution=float(aligned["resolution"].max()) if len(aligned) else 0.0))
    return CurveComparison(reference=reference, tolerance=tolerance, smooth=smooth, exact=exact,
                           differences=differences)


def aligned_losses(reference: pd.DataFrame, other: pd.DataFrame) -> pd.DataFrame:
    """Two runs' losses (rows of load_runs' frame) over what both cover, indexed by step:
    `reference`, `other`, `window` and `resolution` (both logs' rounding, added). Runs logged alike
    pair step by step; where one logs means over windows (a larger `window`), the other's values
    are averaged over each of those windows it covers whole."""
    coarse_is_reference = reference["window"].max() > other["window"].max()
    if reference["window"].max() == other["window"].max():
        joined = reference[["step", "loss", "window", "loss_resolution"]].merge(
            other[["step", "loss", "loss_resolution"]], on="step", suffixes=("_reference", "")).set_index("step")
        return pd.DataFrame({"reference": joined["loss_reference"], "other": joined["loss"],
                             "window": joined["window"],
                             "resolution": joined["loss_resolution_reference"] + joined["loss_resolution"]})
    coarse, fine = (reference, other) if coarse_is_reference else (other, reference)
    steps, windows = fine["step"].to_numpy(), fine["window"].to_numpy()
    sums, resolutions = (fine["loss"] * fine["window"]).to_numpy(), fine["loss_resolution"].to_numpy()
    rows = {}
    for step, window, loss, resolution in coarse[["step", "window", "loss", "loss_resolution"]].itertuples(
            index=False):
        low, high = np.searchsorted(steps, step - window, "right"), np.searchsorted(steps, step, "right")
        whole = high > low and steps[high - 1] == step and windows[low:high].sum() == window \
            and steps[low] - windows[low] >= step - window
        if whole:
            mean = sums[low:high].sum() / window
            pair = (loss, mean) if coarse_is_reference else (mean, loss)
            rows[int(step)] = (*pair, int(window), resolution + resolutions[low:high].max())
    return pd.DataFrame.from_dict(rows, orient="index", columns=["reference", "other", "window", "resolution"])


def relative_error(reference: pd.Series, other: pd.Series, smooth: int = 1) -> pd.Series:
    """|other − reference| / |reference| per step both hold (indexed by step), each smoothed first."""
    common = reference.index.intersection(other.index)
    ref = reference.loc[common].rolling(smooth, min_periods=1).mean()
    own = other.loc[common].rolling(smooth, min_periods=1).mean()
    with np.errstate(divide="ignore", invalid="ignore"):
        return (own - ref).abs() / ref.abs()
