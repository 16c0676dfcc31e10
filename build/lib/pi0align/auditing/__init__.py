"""`pi0align audit DUMP`: one run judged alone, with no second run to hold it to (docs/audit.md).

Where its first NaN or Inf came from (any dump: nonfinite.py), and, where it holds full tensors,
each call against float64: its local error held to the standard of its dtype and API family and
to what the calls of its API introduce elsewhere in the run (local.py, standards.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from pi0align.auditing.nonfinite import edge_values, nonfinite_origins
from pi0align.auditing.result import Audit
from pi0align.compare.reading.open_dump import open_run

__all__ = ["Audit", "audit"]

TENSORS_NEEDED = ("each call against float64 needs full tensors: dump the step in tensor mode "
                  "(pi0align run --dump-mode tensor, Dumper(mode=\"tensor\"))")


def audit(path: str | Path, *, steps: set[int] | None = None, replay: bool = True,
          progress: Callable[..., None] | None = None) -> Audit:
    """Audit the dump at `path` (a dump file, a run folder of one file per rank, or an msprobe
    dump folder): its steps (all, or `steps`), every rank. `replay`: each call against float64
    where the dump holds full tensors. `progress(done, total)`: called as calls are replayed.
    Bad input raises pi0align.errors.UserError (one line)."""
    runs = open_run(path, steps)
    try:
        culprits, edges, notes = [], [], []
        for dump in runs.values():
            culprits += nonfinite_origins(dump)
            edges += edge_values(dump)
        mode = next(iter(runs.values())).mode
        replayed, not_replayed, groups = 0, {}, []
        if mode == "tensor" and replay:
            from pi0align.auditing.local import judge_alone, local_errors

            total = sum(len(set(zip(d.records["step"].tolist(), d.records["call"].tolist()))) for d in runs.values())
            done = 0

            def advance() -> None:
                nonlocal done
                done += 1
                if progress is not None:
                    progress(done, total)

            origins = {(c.rank, c.step, c.direction, c.name) for c in culprits}
            for dump in runs.values():
                calls, skipped = local_errors(dump, advance)
                found, found_groups = judge_alone(calls, dump, origins)
                culprits += found
                groups += found_groups
                replayed += len(calls)
                for reason, count in skipped.items():
                    not_replayed[reason] = not_replayed.get(reason, 0) + count
        elif mode != "tensor":
            notes.append(f"a {mode}-mode dump: NaN and Inf judged; {TENSORS_NEEDED}")
        return Audit(source=str(path), mode=mode, culprits=culprits, culprit_groups=groups, edges=edges,
                     replayed=replayed, not_replayed=not_replayed, notes=notes)
    finally:
        for dump in runs.values():
            dump.close()
