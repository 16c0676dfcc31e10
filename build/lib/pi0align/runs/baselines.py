"""Reference results and a run held to them (`pi0align check RUN --baseline NAME`).

A baseline is a folder (`baselines/<name>/`) holding a run's `train_log.jsonl`, `summary.json` and
`manifest.json` (from a run folder, or from another tool's log: its records, windows of means
included, and what it says of its set-up), and `baseline.json`: what the run is held to (BaselineCriteria) and how the
reference was made. A baseline without a log documents a configuration to reproduce (the case
study's 8-card reference) and cannot be checked against until one is recorded.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from pi0align.errors import UserError, check_writable
from pi0align.runs.curves import TOLERANCE, aligned_losses, compare_curves, log_frame
from pi0align.runs.envdiff import env_diff
from pi0align.runs.folder import LOG, MANIFEST, SUMMARY, Run, read_run

BASELINE = "baseline.json"
PASS, FAIL, NOT_JUDGED = "pass", "fail", "not judged"


@dataclass(frozen=True)
class BaselineCriteria:
    """What a run is held to: its loss curve within `tolerance` (relative, per step, after a
    trailing mean of `smooth` steps) of the baseline's, its final loss within `final_tolerance`,
    and, on the same device, its images/sec at least `min_throughput` × the baseline's."""

    tolerance: float = TOLERANCE
    smooth: int = 1
    final_tolerance: float = TOLERANCE
    min_throughput: float = 0.5

    def __post_init__(self) -> None:
        for name in ("tolerance", "final_tolerance", "min_throughput"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise UserError(f"{name} must be a number, at least 0, not {value!r}")
        if not isinstance(self.smooth, int) or self.smooth < 1:
            raise UserError(f"smooth must be a whole number of steps, at least 1, not {self.smooth!r}")


@dataclass(frozen=True)
class Baseline:
    name: str
    path: Path
    criteria: BaselineCriteria
    description: str
    run: Run | None  # None: a configuration documented, no results recorded


@dataclass(frozen=True)
class Criterion:
    """One line of a check: what, the run's value, the baseline's, PASS / FAIL / NOT_JUDGED, why."""

    name: str
    run: str
    baseline: str
    status: str
    detail: str


@dataclass(frozen=True)
class Check:
    """A run against a baseline: True when no criterion fails."""

    baseline: str
    criteria: list[Criterion]

    def __bool__(self) -> bool:
        return not any(c.status == FAIL for c in self.criteria)


def find_baseline(name: str | Path, root: str | Path = "baselines") -> Path:
    """A baseline folder: a path, or a name under `root`."""
    path = Path(name)
    if (path / BASELINE).is_file():
        return path
    if (Path(root) / name / BASELINE).is_file():
        return Path(root) / name
    known = sorted(p.parent.name for p in Path(root).glob(f"*/{BASELINE}"))
    raise UserError(f"no baseline {str(name)!r} (a folder with {BASELINE}, or one under {root}/: "
                    f"{', '.join(known) or 'none there'})")


def read_baseline(path: str | Path) -> Baseline:
    path = Path(path)
    try:
        described = json.loads((path / BASELINE).read_text())
    except (OSError, ValueError) as error:
        raise UserError(f"{path / BASELINE}: cannot read it ({error})") from None
    if not isinstance(described, dict):
        raise UserError(f"{path / BASELINE}: not a JSON object")
    known = {f.name for f in dataclasses.fields(BaselineCriteria)}
    criteria = BaselineCriteria(**{k: v for k, v in (described.get("criteria") or {}).items() if k in known})
    run = read_run(path, need_log=True) if (path / LOG).is_file() else None
    return Baseline(name=str(described.get("name", path.name)), path=path, criteria=criteria,
                    description=str(described.get("description", "")), run=run)


def check(run: Run, baseline: Baseline, criteria: BaselineCriteria | None = None) -> Check:
    """The run against the baseline's recorded run, by `criteria` (the baseline's by default)."""
    if baseline.run is None:
        raise UserError(f"baseline {baseline.name!r} documents a configuration and holds no results to check "
                        f"against: run it, then record it with `pi0align check RUN --save-baseline {baseline.name}`")
    criteria = criteria or baseline.criteria
    reference = baseline.run
    frames = {"baseline": log_frame(reference.log), "run": log_frame(run.log)}
    frame = pd.concat([f.assign(run=name) for name, f in frames.items()], ignore_index=True)
    curve = compare_curves(frame, tolerance=criteria.tolerance, smooth=criteria.smooth).differences[0]
    logged = len(reference.log)
    over = f" (means over the baseline log's windows of {curve.window} steps)" if curve.window > 1 else ""
    unit = "windows" if curve.window > 1 else "steps"
    lines = [
        Criterion("loss curve", f"{curve.steps} {unit}", f"{logged} {unit}",
                  PASS if curve.within and curve.steps == logged else FAIL,
                  (f"first step outside ±{criteria.tolerance:g}: {curve.first_outside}; " if curve.first_outside
                   is not None else "") + f"mean relative error {curve.mean_relative_error:.3g}{over}"
                  + ("" if curve.steps == logged else "; the run lacks some of the baseline's steps")),
        _final_loss(aligned_losses(frames["baseline"], frames["run"]), reference.log[-1], criteria.final_tolerance),
        _throughput(run, reference, criteria.min_throughput),
    ]
    setup = [line.item for line in env_diff(reference.manifest, run.manifest).matters]
    if setup:
        lines.append(Criterion("setup", "", "", NOT_JUDGED, "differs in what changes the numbers: " + ", ".join(setup)))
    return Check(baseline=baseline.name, criteria=lines)


def _final_loss(aligned: pd.DataFrame, last: dict, tolerance: float) -> Criterion:
    """The run's loss at the baseline's last logged step (over its window where the baseline logs means)."""
    reference = last["loss"]
    if last["step"] not in aligned.index:
        return Criterion("final loss", "—", f"{reference:.6g}", FAIL,
                         f"the run has no step {last['step']}, the baseline's last")
    own = float(aligned.loc[last["step"], "other"])
    error = abs(own - reference) / abs(reference) if reference else math.inf
    window = int(aligned.loc[last["step"], "window"])
    over = f", means of steps {last['step'] - window + 1}–{last['step']}" if window > 1 else ""
    return Criterion("final loss", f"{own:.6g}", f"{reference:.6g}", PASS if error <= tolerance else FAIL,
                     f"relative error {error:.3g} (at most {tolerance:g}{over})")


def _throughput(run: Run, reference: Run, fraction: float) -> Criterion:
    own, theirs = run.summary.get("images_per_sec"), reference.summary.get("images_per_sec")
    if not isinstance(own, (int, float)) or not isinstance(theirs, (int, float)):
        return Criterion("images/sec", str(own), str(theirs), NOT_JUDGED, "not in both summaries")
    device, baseline_device = run.manifest.get("device_name"), reference.manifest.get("device_name")
    if device != baseline_device:
        return Criterion("images/sec", f"{own:.4g}", f"{theirs:.4g}", NOT_JUDGED,
                         f"another device ({device} against {baseline_device}): throughput is not comparable")
    return Criterion("images/sec", f"{own:.4g}", f"{theirs:.4g}", PASS if own >= fraction * theirs else FAIL,
                     f"at least {fraction:g} × the baseline's")


def save_baseline(run: Run, name: str, root: str | Path = "baselines", description: str = "",
                  criteria: BaselineCriteria | None = None) -> Path:
    """Record a run (a run folder's, or what another tool's log holds) as baseline `name` under
    `root`: its log, summary and manifest, and baseline.json."""
    if not name or "/" in name or name.startswith("."):
        raise UserError(f"a baseline's name is one folder name, not {name!r}")
    target = Path(root) / name
    check_writable(target)
    target.mkdir(parents=True, exist_ok=True)
    (target / LOG).write_text("".join(json.dumps(record) + "\n" for record in run.log))
    for file, content in ((SUMMARY, run.summary), (MANIFEST, run.manifest)):
        if content:
            (target / file).write_text(json.dumps(content, indent=2) + "\n")
    described = {"name": name, "description": description or f"recorded from {run.path} ({run.kind})",
                 "criteria": dataclasses.asdict(criteria or BaselineCriteria())}
    (target / BASELINE).write_text(json.dumps(described, indent=2) + "\n")
    return target
