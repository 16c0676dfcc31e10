"""Which steps are judged together: windows of at most ROWS_PER_WINDOW records, and within a step of
more, groups of ranks."""

from __future__ import annotations

from dataclasses import dataclass

from pi0align.compare.reading.open_dump import Run, close_run

# Records judged at once (a window of steps, conclusion.py): a window's rows and their stages take
# about 1.5 KB a record at their peak, so about 150 MB; the dumps' other steps wait on disk.
ROWS_PER_WINDOW = 100_000


@dataclass(frozen=True)
class Window:
    """Steps judged together, and the groups of ranks judged together: every rank in one group,
    except for a step of more than ROWS_PER_WINDOW records, whose ranks are judged a group at a
    time, twice: first to find each group's first culprits, then again knowing the other groups'
    (a call that parts one rank reaches the others through the all-reduce, judge.downstream)."""

    steps: tuple[int, ...]
    rank_groups: tuple[tuple[int, ...], ...]

    @property
    def passes(self) -> int:
        return 1 if len(self.rank_groups) == 1 else 2


def plan_windows(run_a: Run, steps: list[int]) -> list[Window]:
    """The steps in windows of at most ROWS_PER_WINDOW of A's records, every rank's, by each step's
    count where the dump tells it, else as many as its first step holds (read to count, a rank at
    a time). A step of more records has a window of its own, its ranks in groups of at most that
    many (one rank at least each)."""
    held_a = run_a.held
    counts = {step: {rank: held_a[rank].get(step) or 0 for rank in held_a} for step in steps}
    if any(None in ranks.values() for ranks in held_a.values()) and (len(steps) > 1 or len(held_a) > 1):
        first = min(step for ranks in held_a.values() for step in ranks)
        counts = dict.fromkeys(steps, {rank: _records(run_a, first, rank) for rank in held_a})
    found: list[Window] = []
    whole: dict[int, int] = {}  # steps judged with every rank since the last one split, their records

    def add_whole() -> None:
        found.extend(Window(packed, (tuple(run_a.ranks),)) for packed in _packed(whole))
        whole.clear()

    for step in steps:
        if sum(counts[step].values()) > ROWS_PER_WINDOW and len(counts[step]) > 1:
            add_whole()
            found.append(Window((step,), _packed(counts[step])))
        else:
            whole[step] = sum(counts[step].values())
    add_whole()
    return found


def _records(run: Run, step: int, rank: int) -> int:
    """The number of records of one rank at one step, read to count them."""
    opened = run.open({step}, {rank})
    try:
        return sum(len(dump.records) for dump in opened.values())
    finally:
        close_run(opened)


def _packed(counts: dict[int, int]) -> tuple[tuple[int, ...], ...]:
    """The keys (steps, or ranks) in order, in groups of at most ROWS_PER_WINDOW records (`counts`:
    each key's), one key at least each."""
    groups: list[list[int]] = []
    held = 0  # records in the last group
    for key in sorted(counts):
        if not groups or held + counts[key] > ROWS_PER_WINDOW:
            groups.append([])
            held = 0
        groups[-1].append(key)
        held += counts[key]
    return tuple(tuple(group) for group in groups)
