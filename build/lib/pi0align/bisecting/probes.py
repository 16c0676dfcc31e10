"""One-step probes: from the reference run's exact state after K steps (its checkpoint), one step
on this device, as a real `pi0align run --from A --at K` process, so that a probe runs unchanged on
a GPU or an NPU machine, and under several processes where the run's configuration has them.

A probe's folder is kept: a probe whose run finished (its summary written) is read back, not run
again, so an interrupted bisect resumes where it stopped.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from pi0align.errors import UserError
from pi0align.runs.folder import LOG, SUMMARY, read_run

# What a probe does beside its one step: nothing (this device), a noise reference's run (every
# result moved by up to an ulp: how far rounding carries to the loss), or the step dumped in full.
KINDS = {"device": (), "perturbed": ("--perturb-ulps", "1", "--dump-steps", "{step}", "--dump-mode", "stats"),
         "dumped": ("--dump-steps", "{step}", "--dump-mode", "tensor")}


@dataclass(frozen=True)
class Probe:
    """One step run from the reference's state after `step` steps: its loss and gradient norm (before
    clipping), and their relative differences to what the reference logged for that step."""

    step: int
    kind: str  # one of KINDS
    loss: float
    grad_norm: float
    loss_difference: float
    grad_norm_difference: float
    folder: str
    reused: bool = False  # read back from an earlier bisect's folder, not run again


def relative(value: float, reference: float) -> float:
    return abs(value - reference) / abs(reference) if reference else (0.0 if value == reference else float("inf"))


def run_probe(reference: Path, step: int, folder: Path, kind: str, *, logged: dict, device: str | None,
              threads: int | None, label: str = "", include: list[str] | None = None) -> Probe:
    """The probe of `kind` at `step` in `folder` (`label`: its name when there are several of a
    kind), run now or read back; `logged`: the reference's per-step log ({step: record});
    `include`: the names its dump keeps (fnmatch patterns; None: every one)."""
    if not (folder / SUMMARY).is_file():
        shutil.rmtree(folder, ignore_errors=True)  # a probe killed before its end: run again
        extra = [part.format(step=step) for part in KINDS[kind]]
        extra += [argument for pattern in include or () for argument in ("--dump-include", pattern)]
        where = [*(["--device", device] if device else []), *(["--threads", str(threads)] if threads else [])]
        command = [sys.executable, "-m", "pi0align.cli.main", "run", "--from", str(reference), "--at", str(step),
                   "--steps", "1", *where, *extra, "--no-progress", "--log-every", "0", "--out", str(folder)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            why = (done.stderr.strip().splitlines() or ["it ended without a word"])[-1]
            raise UserError(f"the probe at step {step}{label} failed: {why} ({' '.join(command[1:])})")
        reused = False
    else:
        reused = True
    record = next((r for r in read_run(folder, need_log=True).log if r["step"] == step), None)
    if record is None:
        raise UserError(f"{folder / LOG}: no step {step} in it: not a probe of that step")
    own = logged[step]
    return Probe(step=step, kind=kind, loss=float(record["loss"]), grad_norm=float(record["grad_norm"]),
                 loss_difference=relative(float(record["loss"]), float(own["loss"])),
                 grad_norm_difference=relative(float(record["grad_norm"]), float(own["grad_norm"])),
                 folder=str(folder), reused=reused)


def probe_dict(probe: Probe) -> dict:
    """A probe as JSON-ready data (a difference that is no number, null)."""
    return {key: None if isinstance(value, float) and not math.isfinite(value) else value
            for key, value in dataclasses.asdict(probe).items()}


def save_probes(probes: list[Probe], path: Path) -> None:
    """The probes so far, as a table to read (the probes' folders are what a resumed bisect reads)."""
    path.write_text(json.dumps([probe_dict(p) for p in probes], indent=1) + "\n")
