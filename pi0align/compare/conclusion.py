"""Conclusion: the verdict of a comparison judged a window of steps at a time, and the Comparison.

Each window is judged by judging/window.py, knowing what the windows before carried (small: the
comparison's first step and whether the runs are bit-comparable, the latest calls of each parameter
and the optimizer's latest states, each rank's first culprit). The Conclusion folds the judged
windows: the rows go to a RowStore; culprits, counts and notes are gathered. Within a window an
API's calls are each other's peers (judge.stands_out, judge.family_off): a window holds at most
windows.ROWS_PER_WINDOW records, or one step of a group of ranks where a step holds more
(windows.Window): each group is judged knowing the first culprits that the other groups have when
judged alone (`first_culprits`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from pi0align.compare.judging.culprits import MAX_CULPRITS, culprit_order, culprits, first_divergence
from pi0align.compare.judging.explain import first_failing, unexplained_source
from pi0align.compare.judging.groups import culprit_groups, family_counts
from pi0align.compare.judging.judge import Position, first_positions, noise_model
from pi0align.compare.judging.noise import rounding_notes
from pi0align.compare.judging.reference import reference_notes
from pi0align.compare.judging.window import Carried, JudgedWindow, Settings, first_culprits, judge_window
from pi0align.compare.measuring.manifest import manifest_diff, manifest_notes, numerics_notes, weights_comparable
from pi0align.compare.measuring.rank_pair import MeasuredWindow
from pi0align.compare.reading.records import Dump, user_frames
from pi0align.compare.result import PAIRED, PAIRINGS, ROW_COLUMNS, CallRef, Comparison
from pi0align.compare.rowstore import RowStore
from pi0align.compare.table import Table
from pi0align.errors import UserError

# Two runs of one training pair nearly all of the smaller dump's records (one dumped at level api
# against one at mix: all of them); half leaves room for the calls one device fuses or splits.
MIN_PAIRED_SHARE = 0.5
# What judging reads of a dump's records (the steps it holds, a call's stack); the rest is measured
# before it, and let go (engine.py).
RECORD_COLUMNS_JUDGED = ("step", "seq", "call")


class Conclusion:
    """The verdict so far, one judged window after the other (`add`), then the Comparison."""

    settings: Settings | None  # from the first window's manifests
    carried: Carried  # what the next window's judging needs (judging/window.py)
    metrics: tuple[Table, Table] | None  # A's and B's, per training step
    # gathered from every window
    notes: dict[str, None]
    coverage: dict[str, int]  # records by pairing
    unpaired_example: dict[str, str]  # a name of a record of one side only, by side
    ranks: set[int]
    failing_ranks: set[int]
    failed: bool
    weights_culprit: bool  # a culprit among the initial weights: never "aligned"
    rows_over_dtype_limits: int
    explained: dict[str, int]  # rows turned or left `warn`, by rule
    evidence: set[str]
    rounding_count: int
    rounding_names: set[str]
    culprits: list
    guilty: list[Table]  # the culprits' calls of each window, in culprit order
    blame: list[np.ndarray]
    family_counts: dict
    first: CallRef | None
    first_backward: CallRef | None
    first_at: dict[str, tuple]  # (step, phase, seq) of `first` and `first_backward`
    unexplained: tuple | None  # (order key, CallRef or None, note): the first failing row
    steps_held: tuple[set[int], set[int]]
    hyper_parameters: list

    def __init__(self, thresholds: dict, source_a: str, source_b: str, fallback: str, windows: int):
        self.thresholds, self.source_a, self.source_b, self.fallback = thresholds, source_a, source_b, fallback
        self.rows = RowStore(on_disk=windows > 1)
        self.windows = 0
        self.settings, self.carried, self.metrics = None, Carried(), None
        self.notes, self.coverage, self.unpaired_example = {}, dict.fromkeys(PAIRINGS, 0), {}
        self.ranks, self.failing_ranks = set(), set()
        self.failed = self.weights_culprit = False
        self.rows_over_dtype_limits, self.explained, self.evidence = 0, {}, set()
        self.rounding_count, self.rounding_names = 0, set()
        self.culprits, self.guilty, self.blame, self.family_counts = [], [], [], {}
        self.first = self.first_backward = None
        self.first_at, self.unexplained = {}, None
        self.steps_held = (set(), set())
        self.hyper_parameters = []

    def add(self, measured: MeasuredWindow, alongside: Sequence[Position] = ()) -> None:
        """Judge one window (or a group of its ranks) as measured, and fold it in; in a step judged
        a group of ranks at a time, the other groups' `first_culprits` (`alongside`)."""
        rows = self._window_rows(measured)
        runs_a, runs_b = measured.runs_a, measured.runs_b
        for dump in [*runs_a.values(), *runs_b.values()]:
            self.note(dump.notes)
        for rank in measured.ranks:
            self.note(rank.notes)
        if not self.hyper_parameters and measured.ranks and measured.ranks[0].hyper_parameters:
            self.hyper_parameters = list(measured.ranks[0].hyper_parameters)
        for held, runs in zip(self.steps_held, (runs_a, runs_b)):
            held.update(int(s) for run in runs.values() for s in np.unique(run.records["step"]))
        self.windows += 1
        self._count_pairings(rows)
        if not len(rows):
            return
        stack_lookups = {rank: _stack_lookup(dump) for rank, dump in runs_a.items()}
        stack_of = lambda rank, step, seq: stack_lookups[rank](step, seq) if rank in stack_lookups else []
        judged = judge_window(rows, measured.reference, self.settings, self.carried, alongside)
        self.carried = judged.carried
        self._fold(judged, stack_of)

    def first_culprits(self, measured: MeasuredWindow) -> list[Position]:
        """The first culprit of each rank of a group of a step's ranks judged alone (the first
        pass over a step too large to judge whole, windows.Window). Of the rest only what the first
        window carries is kept (the first step, whether the runs are bit-comparable)."""
        rows = self._window_rows(measured)
        if not len(rows):
            return []
        positions, self.carried = first_culprits(rows, measured.reference, self.settings, self.carried)
        return positions

    def _fold(self, judged: JudgedWindow, stack_of: Callable) -> None:
        """A judged window's culprits, counts and rows gathered."""
        rows, calls, judgement, rounding = judged.rows, judged.calls, judged.judgement, judged.rounding
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
        for rule, count in judged.explanation.counts().items():
            self.explained[rule] = self.explained.get(rule, 0) + count
        if failing.any() and self.first is None:  # what parted first, where no call is a culprit
            self._first_failing_row(rows, calls, judged.identity, stack_of)
        self._store(rows)

    def _window_rows(self, measured: MeasuredWindow) -> Table:
        """The window's rows; the runs' metrics and manifests taken from the first window."""
        if self.settings is None:
            first_a, first_b = measured.runs_a[min(measured.runs_a)], measured.runs_b[min(measured.runs_b)]
            self.metrics = (first_a.metrics, first_b.metrics)
            self.settings = Settings(self.thresholds, self.fallback, first_a.manifest, first_b.manifest,
                                     tuple(manifest_diff(first_a.manifest, first_b.manifest)))
        return Table.concat([rank.rows for rank in measured.ranks])

    def _keep_first(self, calls: Table, culprit: np.ndarray, stack_of: Callable) -> None:
        """The first divergence, and the first in a backward pass, of all windows: the earliest in
        execution order (the groups of ranks of one step come one after the other)."""
        backward = calls.isin("direction", "backward")
        for attribute, guilty in (("first", culprit), ("first_backward", culprit & backward)):
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
        diff = list(self.settings.diff)
        notes += manifest_notes(diff) + numerics_notes(self.settings.manifest_a, self.settings.manifest_b)
        notes += _coverage_notes(self.coverage)
        if self.hyper_parameters:
            notes.append("the optimizer's hyper-parameters differ: " + ", ".join(
                f"{key} {va!r} in A, {vb!r} in B" for key, va, vb in self.hyper_parameters))
        first = self.first
        if self.failed and first is None and self.unexplained is not None:
            _, first, note = self.unexplained
            notes.append(note)
        # different initial weights make every later agreement accidental: never "aligned"
        weights_differ = _weights_differ(diff) or self.weights_culprit
        groups = culprit_groups(Table.concat(self.guilty), np.concatenate(self.blame), self.family_counts,
                                self.hyper_parameters) if self.guilty else []
        rank_verdicts = {rank: "diverged" if rank in self.failing_ranks else "aligned" for rank in sorted(self.ranks)}
        return Comparison(
            verdict="diverged" if self.failed or weights_differ or self.culprits else "aligned",
            rows=self.rows, coverage=dict(self.coverage), first_divergence=first, culprits=self.culprits,
            thresholds=self.thresholds, source_a=self.source_a, source_b=self.source_b,
            metrics_a=self.metrics[0], metrics_b=self.metrics[1], manifest_diff=diff, notes=notes,
            first_divergence_backward=self.first_backward, noise_model=noise_model(self.evidence, self.fallback),
            rows_over_dtype_limits=self.rows_over_dtype_limits, culprit_groups=groups,
            explained=self.explained, rank_verdicts=rank_verdicts)

    def note(self, notes: list[str]) -> None:
        self.notes.update(dict.fromkeys(notes))

    def _count_pairings(self, rows: Table) -> None:
        pairing = rows.coded("pairing")
        counts = dict(zip(pairing.distinct.tolist(),
                          np.bincount(pairing.codes, minlength=len(pairing.distinct)).tolist()))
        self.coverage["matched"] += sum(counts.get(label, 0) for label in PAIRED)
        for label in PAIRINGS[1:]:
            self.coverage[label] += counts.get(label, 0)
        for side in "ab":
            if side not in self.unpaired_example and counts.get(f"only_{side}"):
                found = rows["name"][rows.isin("pairing", f"only_{side}")]
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


def _weights_differ(diff: list) -> bool:
    """The manifests' weights hashes differ, taken in the same dtype (in another dtype the same
    initial weights hash apart: the parameter records tell instead)."""
    return weights_comparable(diff) and any(key == "weights_sha256" and None not in (va, vb) for key, va, vb in diff)


def _coverage_notes(coverage: dict[str, int]) -> list[str]:
    return [f"{coverage[label]} records only in {side} (listed as {label})"
            for label, side in (("only_a", "A"), ("only_b", "B")) if coverage[label]]
