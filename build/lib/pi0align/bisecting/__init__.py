"""`pi0align bisect A B`: from "the curves part" to the step and the call (docs/bisect.md).

A is the reference run (a run folder with checkpoints), B the run under test (its log at least),
and this machine is B's device. One step from A's exact state after K steps, run here, lands within
a bound of A's own step K while this device computes that step as A's did: the bound is measured
at A's first checkpoint, by this device's one step and a noise reference's (every result moved by
an ulp), not assumed. A binary search over A's checkpoints finds the first whose one step is beyond
it (a state from which this device computes a different step); that step is run again from the
same state (two runs that differ: this device is not deterministic there), dumped, and its
culprit named, by `compare` against A's dump of that step where A's folder has one, else by
`audit`. Where both runs have a monitor, its first module to leave the band narrows both: the
checkpoints searched end at its step when that comes before the loss's, and an audited step's dump
holds that module's calls only. When no checkpoint is beyond the bound, the curves part by the two devices' rounding,
which training amplifies, not by a step that computes differently.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from pi0align.bisecting.probes import Probe, run_probe, save_probes
from pi0align.bisecting.result import Bisection, Bound
from pi0align.bisecting.runs import Runs, read_runs
from pi0align.compare.judging.reference import REFERENCE_MARGIN
from pi0align.compare.judging.thresholds import UNIT_ROUNDOFF
from pi0align.errors import UserError
from pi0align.runs.curves import TOLERANCE

__all__ = ["Bisection", "Bound", "Probe", "bisect"]

# the smallest bound: a loss and a gradient norm logged in float32, rounded a few times
FLOOR = 16 * UNIT_ROUNDOFF["float32"]


def bisect(a: str | Path, b: str | Path, *, out: str | Path | None = None, tolerance: float = TOLERANCE,
           device: str | None = None, report: Callable[[Probe, Bound | None], None] | None = None,
           starting: Callable[[int, str], None] | None = None) -> Bisection:
    """Bisect B against A's checkpoints on this device (`device`: B's, from its manifest, unless
    given), keeping every probe under `out` (default `<B>/bisect`): a bisect run again there reads
    the probes it finished back. `tolerance`: the relative loss error where B's curve leaves A's
    band (`curves`' rule), which bounds the checkpoints searched. `report(probe, bound)`: called as
    each probe finishes (the bound None while it is being measured); `starting(step, kind)` as
    each begins. Bad input: UserError."""
    runs = read_runs(a, b, tolerance, device)
    out = Path(out) if out is not None else runs.under_test / "bisect"
    try:
        (out / "probes").mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UserError(f"cannot write {out}: {error.strerror or error}") from None
    # up to the first checkpoint at or past the step where B first parts (its loss, or a module
    # first): a step computed differently there is first seen from that checkpoint on (or earlier)
    parts = runs.parts_first_at
    last = next((k for k in runs.checkpoints if parts is not None and k >= parts), runs.checkpoints[-1])
    searched = [k for k in runs.checkpoints if k <= last]
    probes: list[Probe] = []
    bound: Bound | None = None

    def probe(step: int, kind: str = "device", again: str = "", include: list[str] | None = None) -> Probe:
        """A probe at `step`, its folder named by step and kind (`again`: a second of its kind);
        `include`: the names its dump keeps."""
        if starting is not None:
            starting(step, kind)
        found = run_probe(runs.reference, step, out / "probes" / f"{step:06d}-{kind}{again}", kind,
                          logged=runs.logged, device=runs.device, threads=runs.threads,
                          label=f" ({kind}{again})", include=include)
        probes.append(found)
        save_probes(probes, out / "probes.json")
        if report is not None:
            report(found, bound)
        return found

    first = probe(searched[0])
    if _differ(first, again := probe(searched[0], again="-again")):  # no bound can be measured: say why
        bound = Bound(float("nan"), float("nan"), f"none: this device's step {searched[0]} differs run to run")
        return _nondeterministic(dict(runs=runs, probes=probes, bound=bound, searched=searched), out, searched[0],
                                 first, again, probe)
    calibration = [first, probe(searched[0], "perturbed")]
    bound = Bound(loss=REFERENCE_MARGIN * max(FLOOR, *(p.loss_difference for p in calibration)),
                  grad_norm=REFERENCE_MARGIN * max(FLOOR, *(p.grad_norm_difference for p in calibration)),
                  measured_by=f"{REFERENCE_MARGIN:g} × the larger of this device's one step and a noise reference's "
                              f"(every result moved by an ulp) from step {searched[0]}")
    done = dict(runs=runs, probes=probes, bound=bound, searched=searched)
    if len(searched) < 2 or not bound.beyond(last := probe(searched[-1])):
        return Bisection(**_common(**done), first_checkpoint_beyond=None, notes=_within_notes(probes, bound))
    low, high, beyond = 0, len(searched) - 1, last
    while high - low > 1:
        middle = probe(searched[(low + high) // 2])
        if bound.beyond(middle):
            high, beyond = (low + high) // 2, middle
        else:
            low = (low + high) // 2
    return _name_the_culprit(done, out, searched[high], beyond, probe)


def _common(runs: Runs, probes: list[Probe], bound: Bound, searched: list[int]) -> dict:
    return dict(reference=str(runs.reference), under_test=str(runs.under_test), probes=list(probes), bound=bound,
                searched=searched, parts_at=runs.parts_at, first_module=runs.first_module, monitors=runs.monitors)


def _within_notes(probes: list[Probe], bound: Bound) -> list[str]:
    widest = max((p for p in probes if p.kind == "device"), key=lambda p: p.loss_difference / bound.loss)
    return [f"no step computes differently: one step on this device from every checkpoint probed lands within "
            f"the bound (the largest at step {widest.step}: loss {widest.loss_difference:.3g} against "
            f"{bound.loss:.3g}, gradient norm {widest.grad_norm_difference:.3g} against {bound.grad_norm:.3g}); "
            "where the curves part, they part by the two devices' rounding, which training amplifies"]


def _differ(probe: Probe, again: Probe) -> bool:
    """Two runs of one step from one state: their loss or gradient norm hold other bits."""
    return (probe.loss, probe.grad_norm) != (again.loss, again.grad_norm)


def _name_the_culprit(done: dict, out: Path, step: int, beyond: Probe, probe) -> Bisection:
    """The step that computes differently, run again from the same state with its tensors dumped:
    where the two runs differ, this device is not deterministic there; else its culprit, by
    compare against the reference's dump of that step, or by audit."""
    runs = done["runs"]
    held = _holds_dump(runs.reference, step)
    # the module the monitor names first: an audited dump need hold its calls only (compare reads
    # the reference's whole dump, and pairs whole steps)
    include = None if held or runs.first_module is None else [f"{runs.first_module.module}.*",
                                                              f"{runs.first_module.module}/*"]
    dumped = probe(step, "dumped", include=include)
    if _differ(beyond, dumped):
        return _nondeterministic(done, out, step, beyond, dumped, probe)
    commands = [f"pi0align run --from {runs.reference} --at {step} --steps 1 --dump-steps {step} --dump-mode tensor "
                f"--out {out}/reference-{step:06d}   # on the reference's device",
                f"pi0align compare {out}/reference-{step:06d} {dumped.folder}"]
    culprit, judged_by = _culprit(runs.reference, Path(dumped.folder), step, held)
    if include is not None:
        judged_by += f", its dump narrowed to {runs.first_module.module} (the monitor's first module to part)"
    notes = [] if culprit is not None else [
        f"step {step} computes differently on this device, yet no call of its dump is beyond its standard alone: "
        "dump the step on the reference's device and compare (the commands below)"]
    return Bisection(**_common(**done), first_checkpoint_beyond=step, culprit=culprit, judged_by=judged_by,
                     commands=commands, notes=notes)


def _nondeterministic(done: dict, out: Path, step: int, one: Probe, other: Probe, probe) -> Bisection:
    """One step run twice from one state differs: this device is not deterministic there. The first
    call that differs between two dumps of it (bit for bit: evidence `exact`), not a kernel."""
    from pi0align.compare import compare_dumps

    dumped = [p for p in (one, other) if p.kind == "dumped"]
    while len(dumped) < 2:
        dumped.append(probe(step, "dumped", "-again" if dumped else ""))
    comparison = compare_dumps(dumped[0].folder, dumped[1].folder, replay=False)
    culprit = comparison.culprits[0] if comparison.culprits else comparison.first_divergence
    note = (f"step {step} run twice from the same state on this device differs (loss {one.loss!r} and "
            f"{other.loss!r}): this device is not deterministic there"
            + (f", first at {culprit.name}" if culprit else "") + ": no kernel to blame")
    return Bisection(**_common(**done), first_checkpoint_beyond=step, nondeterministic=True, culprit=culprit,
                     judged_by="two dumps of the step from the same state, compared", notes=[note])


def _holds_dump(reference: Path, step: int) -> bool:
    """Whether the reference's folder holds a dump of the step."""
    from pi0align.compare.reading.open_dump import dumped_steps

    try:
        return any(step in steps for steps in dumped_steps(reference).values())
    except UserError:  # no dump in the reference's folder
        return False


def _culprit(reference: Path, dumped: Path, step: int, held: bool):
    """The top culprit of the dumped step: against the reference's own dump of it (compare) where
    its folder holds one (`held`), else the step judged alone (audit)."""
    if held:
        from pi0align.compare import compare_dumps

        culprits = compare_dumps(reference, dumped, steps=[step]).culprits
        return (culprits[0] if culprits else None), "compare against the reference's dump of the step"
    from pi0align.auditing import audit

    culprits = audit(dumped).culprits
    return (culprits[0] if culprits else None), "audit of the step (the reference's folder holds no dump of it)"
