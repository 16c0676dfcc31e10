"""Conclusion: the verdict of a comparison judged a window of steps at a time, and the Comparison.

Each window's rows go through the verdict's stages, each a function of the ones before: rows
against their limits (verdict.py), the call table (rootcause.py), the judgement of each call
(judge.py), and which failing rows the noise model explains (explain.py). What a later window
needs of the earlier ones is carried, and is small: the comparison's first step and whether the
runs are bit-comparable (from the first window), the latest calls of each parameter (what the next
step's parameters read), the optimizer's latest state outputs of each parameter (what the next
update reads, after a gap in the dumped steps too), and each rank's first culprit (everything after
it may inherit its error). The rows are written to a RowStore; culprits, counts and notes are
gathered. Within a window an API's calls are each
other's peers (judge.stands_out, judge.family_off): a window holds at most engine.ROWS_PER_WINDOW
records, or one step of a group of ranks where a step holds more (engine.Window): each group is
judged knowing the first culprits that the other groups have when judged alone (`first_culprits`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from pi0align.compare.judging.explain import (
    explain,
    first_failing,
    optimizer_states,
    rows_of,
    unexplained_source,
)
from pi0align.compare.judging.groups import culprit_groups, family_counts
from pi0align.compare.judging.identity import tensor_identities
from pi0align.compare.judging.judge import (
    Judgement,
    Position,
    bit_comparable,
    computes_alike,
    first_positions,
    judge,
    noise_model,
)
from pi0align.compare.judging.manifest import (
    host_cpus_differ,
    manifest_diff,
    manifest_notes,
    numerics_notes,
    same_initial_weights,
    weights_comparable,
)
from pi0align.compare.judging.noise import rounding_level, rounding_notes
from pi0align.compare.judging.reference import reference_notes
from pi0align.compare.judging.rootcause import (
    MAX_CULPRITS,
    call_table,
    culprit_order,
    culprits,
    first_divergence,
    parameter_calls,
    producers,
)
from pi0align.compare.judging.verdict import RowVerdicts, judge_rows
from pi0align.compare.reading.records import OUTPUT_ROLES, Dump, user_frames
from pi0align.compare.result import ROW_COLUMNS, CallRef, Comparison
from pi0align.compare.rowstore import RowStore
from pi0align.compare.table import Table, gather, isin, lookup
from pi0align.errors import UserError

PAIRED = ("matched", "realigned", "shape_mismatch", "dtype_mismatch")  # a record with its counterpart
# Two runs of one training pair nearly all of the smaller dump's records (one dumped at level api
# against one at mix: all of them); half leaves room for the calls one device fuses or splits.
MIN_PAIRED_SHARE = 0.5
# What judging reads of a dump's records (the steps it holds, a call's stack); the rest is measured
# before it, and let go (engine.py).
RECORD_COLUMNS_JUDGED = ("step", "seq", "call")


class _Stages(NamedTuple):
    """A window's rows through the verdict's stages up to the judgement of each call."""

    judged_rows: RowVerdicts
    rounding: np.ndarray
    identity: np.ndarray
    producer: np.ndarray
    calls: Table
    judgement: Judgement
    noisy_start: bool


class Conclusion:
    """The verdict so far, one window of steps after the other (`add`), then the Comparison."""

    def __init__(self, thresholds: dict, source_a: str, source_b: str, fallback: str, windows: int):
        self.thresholds, self.source_a, self.source_b, self.fallback = thresholds, source_a, source_b, fallback
        self.rows = RowStore(on_disk=windows > 1)
        self.windows = 0
        # carried from window to window (the module's docstring)
        self.first_step: int | None = None
        self.exact: bool | None = None
        self.parameters: Table | None = None
        self.states: Table | None = None
        self.earlier: list = []
        # gathered
        self.notes: dict[str, None] = {}
        self.coverage = dict.fromkeys(("matched", "only_a", "only_b", "realigned", "shape_mismatch",
                                       "dtype_mismatch"), 0)
        self.unpaired_example: dict[str, str] = {}
        self.failed = self.weights_culprit = False
        self.ranks: set[int] = set()
        self.failing_ranks: set[int] = set()
        self.rows_over_dtype_limits = 0
        self.explained: dict[str, int] = {}
        self.evidence: set[str] = set()
        self.rounding_count, self.rounding_names = 0, set()
        self.culprits: list = []
        self.guilty: list[Table] = []  # the culprits' calls of each window, in culprit order
        self.blame: list[np.ndarray] = []
        self.family_counts: dict = {}
        self.first: CallRef | None = None
        self.first_backward: CallRef | None = None
        self.first_at: dict[str, tuple] = {}  # (step, phase, seq) of `first` and `first_backward`
        self.unexplained: tuple | None = None  # (order key, CallRef or None, note): the first failing row
        self.steps_held: tuple[set[int], set[int]] = (set(), set())
        self.metrics: tuple[Table, Table] | None = None  # A's and B's, per training step
        self.manifests: tuple[dict, dict] = ({}, {})
        self.diff: list = []
        self.hyper_parameters: list = []

    def add(self, parts: list[tuple[Table, list[str], list]], runs_a: dict[int, Dump], runs_b: dict[int, Dump],
            reference: Table | None, alongside: Sequence[Position] = ()) -> None:
        """Judge one window: `parts`, each rank's measured rows, notes and differing optimizer
        settings (engine._compare_rank); the window's dumps; the noise reference's rows, if any;
        in a step judged a group of ranks at a time, the other groups' `first_culprits`."""
        rows = self._window_rows(parts, runs_a, runs_b)
        for dump in [*runs_a.values(), *runs_b.values()]:
            self.note(dump.notes)
        for part in parts:
            self.note(part[1])
        if not self.hyper_parameters and parts and parts[0][2]:
            self.hyper_parameters = parts[0][2]
        for held, runs in zip(self.steps_held, (runs_a, runs_b)):
            held.update(int(s) for run in runs.values() for s in np.unique(run.records["step"]))
        self.windows += 1
        self._count_pairings(rows)
        if not len(rows):
            return
        stack_lookups = {rank: _stack_lookup(dump) for rank, dump in runs_a.items()}
        stack_of = lambda rank, step, seq: stack_lookups[rank](step, seq) if rank in stack_lookups else []

        earlier = [*self.earlier, *alongside]
        judged_rows, rounding, identity, producer, calls, judgement, noisy_start = self._stages(rows, reference,
                                                                                                earlier)
        explanation = explain(rows, judged_rows.verdict, rounding, identity, producer, calls, judgement,
                              earlier, self.states, noisy_start)

        rows["severity"], rows["over_dtype_limits"] = judged_rows.severity, judged_rows.over_dtype_limits
        rows["verdict"], rows["explained_by"] = explanation.verdict, explanation.explained_by
        exact = rows_of(rows, calls, judgement.culprit & (judgement.evidence == "exact"))
        # a change its statistics may not see
        rows["verdict"][exact & isin(rows["role"], OUTPUT_ROLES) & ~rows["identical"]] = "fail"
        rows["introduced_error"] = _introduced_per_row(rows, calls)

        self.parameters = parameter_calls(calls, self.parameters)
        self.states = optimizer_states(rows, rows["verdict"], rounding, self.states)  # what the next updates read
        ranks_parted = {position[0] for position in self.earlier}  # their first culprits came in earlier windows
        self.earlier += [p for p in first_positions(calls, judgement.culprit) if p[0] not in ranks_parted]
        self.rounding_count += int(rounding.sum())
        self.rounding_names.update(rows["name"][rounding].tolist())
        self.evidence.update(judgement.evidence.tolist())
        self.family_counts = family_counts(calls, self.family_counts)
        order = culprit_order(calls, judgement)
        self.guilty.append(calls.take(order))
        self.blame.append(judgement.blame[order])
        if len(self.culprits) < MAX_CULPRITS:  # the windows' steps follow each other: so do their culprits
            self.culprits += culprits(calls, judgement, stack_of)[:MAX_CULPRITS - len(self.culprits)]
        self._keep_first(calls, judgement.culprit, stack_of)
        self.weights_culprit |= bool((judgement.culprit & (calls["kind"] == "initial_weights")).any())
        failing = rows["verdict"] == "fail"
        self.failed |= bool(failing.any())
        self.failing_ranks.update(np.unique(rows["rank"][failing]).tolist())
        self.failing_ranks.update(calls["rank"][judgement.culprit].tolist())
        self.rows_over_dtype_limits += int(rows["over_dtype_limits"].sum())
        for rule, count in explanation.counts().items():
            self.explained[rule] = self.explained.get(rule, 0) + count
        if failing.any() and self.first is None:  # what parted first, where no call is a culprit
            self._first_failing_row(rows, calls, identity, stack_of)
        self._store(rows)

    def first_culprits(self, parts: list[tuple[Table, list[str], list]], runs_a: dict[int, Dump],
                       runs_b: dict[int, Dump], reference: Table | None) -> list[Position]:
        """The first culprit of each rank of a group of a step's ranks judged alone (the first
        pass over a step too large to judge whole, engine.Window); nothing is kept of them."""
        rows = self._window_rows(parts, runs_a, runs_b)
        if not len(rows):
            return []
        stages = self._stages(rows, reference, self.earlier)
        return first_positions(stages.calls, stages.judgement.culprit)

    def _window_rows(self, parts: list[tuple[Table, list[str], list]], runs_a: dict[int, Dump],
                     runs_b: dict[int, Dump]) -> Table:
        """The window's rows; the runs' metrics and manifests taken from the first window."""
        if self.metrics is None:
            first_a, first_b = runs_a[min(runs_a)], runs_b[min(runs_b)]
            self.metrics = (first_a.metrics, first_b.metrics)
            self.manifests = (first_a.manifest, first_b.manifest)
            self.diff = manifest_diff(first_a.manifest, first_b.manifest)
        return Table.concat([p[0] for p in parts])

    def _stages(self, rows: Table, reference: Table | None, earlier: Sequence[Position]) -> _Stages:
        """The rows against their limits, the call table and the judgement of each call (the
        comparison's first step and whether the runs are bit-comparable taken from the first)."""
        judged_rows = judge_rows(rows, self.thresholds, reference)
        rounding = rounding_level(rows, judged_rows.verdict)
        rows["identical"] = judged_rows.identical
        if self.first_step is None:
            self.first_step = int(rows["step"].min())
            self.exact = bit_comparable(rows, judged_rows.identical, self.diff, self.manifests[0])
        identity = tensor_identities(rows)
        producer = producers(rows, judged_rows.verdict, identity)
        # the same initial weights, which rounding alone may have parted by a first dumped step past 0
        # (or from one seed's weights, drawn by two hosts' CPUs: apart by rounding only)
        noisy_start = (same_initial_weights(self.diff, *self.manifests) or host_cpus_differ(self.diff)) and \
            not computes_alike(self.diff, self.manifests[0])
        calls = call_table(rows, judged_rows.verdict, rounding, identity, producer, self.first_step, self.parameters,
                           noisy_start)
        judgement = judge(calls, self.fallback, exact=self.exact, earlier=earlier)
        return _Stages(judged_rows, rounding, identity, producer, calls, judgement, noisy_start)

    def _keep_first(self, calls: Table, culprit: np.ndarray, stack_of: Callable) -> None:
        """The first divergence, and the first in a backward pass, of all windows: the earliest in
        execution order (the groups of ranks of one step come one after the other)."""
        for attribute, guilty in (("first", culprit), ("first_backward", culprit & (calls["direction"] == "backward"))):
            found = first_positions(calls, guilty)
            if not found:
                continue
            at = min(tuple(position[1:]) for position in found)
            if attribute not in self.first_at or at < self.first_at[attribute]:
                self.first_at[attribute] = at
                setattr(self, attribute, first_divergence(calls, guilty, stack_of))

    def comparison(self, runs_reference: dict[int, Dump] | None) -> Comparison:
        """The Comparison of every window added."""
        self._check_steps_held()
        self._check_runs_pair()
        notes = list(self.notes) + rounding_notes(self.rounding_count, self.rounding_names)
        if runs_reference is not None:
            notes += reference_notes(runs_reference)
        notes += manifest_notes(self.diff) + numerics_notes(*self.manifests)
        notes += _coverage_notes(self.coverage)
        if self.hyper_parameters:
            notes.append("the optimizer's hyper-parameters differ: " + ", ".join(
                f"{key} {va!r} in A, {vb!r} in B" for key, va, vb in self.hyper_parameters))
        first = self.first
        if self.failed and first is None and self.unexplained is not None:
            _, first, note = self.unexplained
            notes.append(note)
        # different initial weights make every later agreement accidental: never "aligned"
        weights_differ = _weights_differ(self.diff) or self.weights_culprit
        groups = culprit_groups(Table.concat(self.guilty), np.concatenate(self.blame), self.family_counts,
                                self.hyper_parameters) if self.guilty else []
        rank_verdicts = {rank: "diverged" if rank in self.failing_ranks else "aligned" for rank in sorted(self.ranks)}
        return Comparison(
            verdict="diverged" if self.failed or weights_differ or self.culprits else "aligned",
            rows=self.rows, coverage=dict(self.coverage), first_divergence=first, culprits=self.culprits,
            thresholds=self.thresholds, source_a=self.source_a, source_b=self.source_b,
            metrics_a=self.metrics[0], metrics_b=self.metrics[1], manifest_diff=self.diff, notes=notes,
            first_divergence_backward=self.first_backward, noise_model=noise_model(self.evidence, self.fallback),
            rows_over_dtype_limits=self.rows_over_dtype_limits, culprit_groups=groups,
            explained=self.explained, rank_verdicts=rank_verdicts)

    def note(self, notes: list[str]) -> None:
        self.notes.update(dict.fromkeys(notes))

    def _count_pairings(self, rows: Table) -> None:
        pairing = rows["pairing"]
        self.coverage["matched"] += int(isin(pairing, PAIRED).sum())
        for label in ("only_a", "only_b", "realigned", "shape_mismatch", "dtype_mismatch"):
            self.coverage[label] += int((pairing == label).sum())
        for side in "ab":
            if side not in self.unpaired_example:
                found = rows["name"][pairing == f"only_{side}"]
                if len(found):
                    self.unpaired_example[side] = found[0]
        self.ranks.update(np.unique(rows["rank"]).tolist())

    def _first_failing_row(self, rows: Table, calls: Table, identity: np.ndarray, stack_of: Callable) -> None:
        """Keep the first failing row of all windows (explain.first_failing's order)."""
        _, key = first_failing(rows)
        if self.unexplained is None or key < self.unexplained[0]:
            self.unexplained = (key, *unexplained_source(rows, calls, identity, stack_of))

    def _store(self, rows: Table) -> None:
        """The window's rows, ROW_COLUMNS, each rank's a part (read in order of rank, then step)."""
        if not len(rows):
            return
        rows = rows.select(ROW_COLUMNS)
        order = np.lexsort((rows["seq_b"], rows["seq_a"], rows["step"], rows["rank"]))  # NaN (no record) last
        rows = rows.take(order)
        ranks, starts = np.unique(rows["rank"], return_index=True)
        for rank, start, stop in zip(ranks.tolist(), starts.tolist(), [*starts[1:].tolist(), len(rows)]):
            self.rows.append(rows.between(start, stop), (rank, self.windows))

    def _check_steps_held(self) -> None:
        for source, held in zip((self.source_a, self.source_b), self.steps_held):
            if not held:
                raise UserError(f"{source} holds no complete dumped step" + (f" ({next(iter(self.notes))})"
                                                                             if self.notes else ""))

    def _check_runs_pair(self) -> None:
        """Dumps of which the smaller pairs mostly with nothing in the other (other models, other
        names) are not two runs of one training: no verdict, which would name a culprit among the
        few records that happen to pair."""
        paired = self.coverage["matched"]
        held = {"a": paired + self.coverage["only_a"], "b": paired + self.coverage["only_b"]}
        smaller = min(held, key=held.get)
        if paired and paired >= MIN_PAIRED_SHARE * held[smaller]:
            return
        source, other = (self.source_a, self.source_b) if smaller == "a" else (self.source_b, self.source_a)
        example = {side: self.unpaired_example.get(side, "nothing") for side in "ab"}
        raise UserError(f"{paired} of the {held[smaller]} records of {source} pair with one of {other} in the steps "
                        f"they share: A's calls are named like {example['a']!r}, B's like {example['b']!r} (dumps of "
                        "different models?)")


def _stack_lookup(dump: Dump) -> Callable[[int, int], list[str]]:
    """(step, seq) -> user frames of the call, for the culprit report (a few calls: the index of
    the dump's records is made at the first)."""
    records = dump.records
    call_of: dict[tuple[int, int], int] = {}

    def stack(step: int, seq: int) -> list[str]:
        if not call_of:
            call_of.update(zip(zip(records["step"].tolist(), records["seq"].tolist()), records["call"].tolist()))
        call = call_of.get((step, seq))
        return [] if call is None else user_frames(dump.stacks.get((step, call), []))

    return stack


def _introduced_per_row(rows: Table, calls: Table) -> np.ndarray:
    """The call's introduced error on its output rows, NaN elsewhere."""
    keys = ("rank", "step", "direction")
    call = lookup([*(rows[k] for k in keys), rows["seq_a"]],
                  [*(calls[k] for k in keys), calls["seq_a"].astype(np.float64)])
    return np.where(isin(rows["role"], OUTPUT_ROLES), gather(calls["introduced_error"], call, np.nan), np.nan)


def _weights_differ(diff: list) -> bool:
    """The manifests' weights hashes differ, taken in the same dtype (in another dtype the same
    initial weights hash apart: the parameter records tell instead)."""
    return weights_comparable(diff) and any(key == "weights_sha256" and None not in (va, vb) for key, va, vb in diff)


def _coverage_notes(coverage: dict[str, int]) -> list[str]:
    return [f"{coverage[label]} records only in {side} (listed as {label})"
            for label, side in (("only_a", "A"), ("only_b", "B")) if coverage[label]]
