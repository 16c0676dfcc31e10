"""`pi0align replay DUMP NAME [--against OTHER]`: replay one dumped call, or one optimizer update,
in float64 on the CPU and print each side's local error (its results against the float64 result
of its own inputs). A batch (`.../Data#k`) is read, not computed: its checksums are compared.

Exit code: 0 (no side wrong; the batches hold the same bits), 1 (a side's local error is beyond
the other's, as compare judges it; the batches differ), 2 bad input (one line on stderr).
"""

from __future__ import annotations

import argparse

from pi0align.cli.steps import parse_steps


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dump", metavar="DUMP", help="a tensor-mode pi0align dump file or run folder")
    parser.add_argument("name", metavar="NAME",
                        help="the call's name, e.g. 'model.layers.1.mlp/Functional.gelu#0'; an optimizer update "
                             "'<parameter>/Optimizer.step#0'; a batch '<key>/Data#0'")
    parser.add_argument("--against", metavar="OTHER", help="the other run's dump: replay its call of that name too")
    parser.add_argument("--step", type=parse_steps, help="the step (default: the first that holds the call)")
    parser.add_argument("--direction", choices=("forward", "backward"), default=None,
                        help="forward or backward (default: forward; an update's and a batch's own)")
    parser.add_argument("--rank", type=int, default=0, help="the rank, in a run folder of several (default: 0)")


def main(args: argparse.Namespace) -> int:
    import numpy as np
    from rich.console import Console
    from rich.table import Table

    from pi0align.compare.judging.judge import wrong_sides
    from pi0align.compare.judging.thresholds import UNIT_ROUNDOFF, dtype_class
    from pi0align.compare.measuring.replayed import RESULT_ROLES, RecordedCalls
    from pi0align.errors import UserError
    from pi0align.replay import replay
    from pi0align.report.formatting import ShortNames, format_number

    if args.step is not None and len(args.step) != 1:
        raise UserError("--step takes one step")
    kind = "optimizer" if "/Optimizer.step#" in args.name else "data" if "/Data#" in args.name else "forward"
    if args.direction is not None and kind != "forward":
        what = "an optimizer update" if kind == "optimizer" else "a batch"
        raise UserError(f"--direction is for API calls; {args.name} is {what}")
    direction = args.direction or kind
    step = args.step[0] if args.step else None
    paths = [args.dump] + ([args.against] if args.against else [])
    results, units, conditions, checksums, modules = [], [], [], [], set()
    for path in paths:
        runs = _open_holding(path, args.name, step, direction, args.rank)
        try:
            dump = runs[args.rank]
            if dump.mode != "tensor" and direction != "data":
                raise UserError(f"{path}: a {dump.mode}-mode dump: replay needs full tensors (--dump-mode tensor)")
            calls = RecordedCalls(dump)
            found = calls.find(args.name, step, direction)
            if found is None:
                what = {"optimizer": "optimizer update", "data": "batch record"}.get(direction, f"{direction} call")
                raise UserError(f"{path}: no {what} named {args.name!r}"
                                + (f" at step {step}" if step is not None else ""))
            step = found[0]
            records = dump.records
            modules.update(records["module"].tolist())
            mine = (records["step"] == found[0]) & (records["call"] == found[1])
            if direction == "data":  # read, not computed: nothing to replay, its bits tell
                checksums.append(int(records["checksum"][mine][0]))
                continue
            recorded = calls.recorded(*found, direction)
            if isinstance(recorded, str):
                raise UserError(f"{path}: {args.name} cannot be replayed: {recorded}")
            result = replay(recorded)
            if not result:
                raise UserError(f"{path}: {args.name} cannot be replayed: {result.reason}")
            conditions.append(_condition(records, mine, direction))
            mine &= records["role"] == RESULT_ROLES[direction]
            units.append(max((UNIT_ROUNDOFF[dtype_class(d)] for d in records["dtype"][mine].tolist()), default=0.0))
            results.append(result)
        finally:
            for run in runs.values():
                run.close()

    console = Console()
    if direction == "data":
        return _batch(console, args.name, step, paths, checksums)
    about = f" · step {step} · {direction}: local error against float64"
    name = ShortNames(modules).name(args.name, max(console.width - len(about), 24))  # whole parts, never cut
    table = Table(title=name + about, title_justify="left")
    table.add_column("result", justify="right")
    for label in ("A", "B")[:len(results)]:
        table.add_column(f"{label} ({paths[0 if label == 'A' else 1]})", justify="right", overflow="fold")
    for index in sorted(set().union(*(r.errors for r in results))):
        table.add_row(str(index), *(format_number(r.errors.get(index, float("nan"))) for r in results))
    console.print(table)
    if len(results) < 2:
        console.print(f"unit roundoff of the result dtype: {format_number(units[0])}")
        return 0
    b_wrong, a_wrong, _ = (bool(v[0]) for v in wrong_sides(*(np.array([x]) for x in (
        results[0].error, results[1].error, units[0], units[1], *conditions[0]))))
    verdict = "B is wrong" if b_wrong else "A is wrong" if a_wrong else "both within noise of each other"
    console.print(f"verdict: {verdict}", style="bold red" if b_wrong or a_wrong else "bold green")
    return 1 if b_wrong or a_wrong else 0


def _open_holding(path: str, name: str, step: int | None, direction: str, rank: int) -> dict:
    """The run at `path` holding the records of `step`, or where no step is given, of the first step
    whose records hold the call (read a step at a time: a long dump's records need not fit in memory)."""
    from pi0align.compare.measuring.replayed import RecordedCalls
    from pi0align.compare.reading.open_dump import dumped_steps, open_run
    from pi0align.errors import UserError

    held = dumped_steps(path)
    if rank not in held:
        raise UserError(f"{path} has no rank {rank} (ranks: {', '.join(map(str, sorted(held)))})")
    steps = [step] if step is not None else list(held[rank])
    for candidate in steps[:-1]:
        runs = open_run(path, {candidate})
        if RecordedCalls(runs[rank]).find(name, candidate, direction) is not None:
            return runs
        for run in runs.values():
            run.close()
    return open_run(path, set(steps[-1:]))  # the last step: the caller says whether it holds the call


def _condition(records, mine, direction: str) -> tuple[float, str, str]:
    """The call's condition, its rule and its API (bounds.conditions, bounds.rounding_floor: how much
    its own rounding grows), from its records (`mine`) and, for a backward call, its forward call's
    (what it saved), as compare takes them."""
    import numpy as np

    from pi0align.compare.judging.calltable.bounds import CallRecords, conditions
    from pi0align.compare.table import Groups, Table

    first = int(np.flatnonzero(mine)[0])
    related = mine | ((records["step"] == records["step"][first]) & (records["name"] == records["name"][first])
                      & records.isin("direction", "forward"))
    own = records.take(related)
    call = Groups(own["direction"])  # the call, and its forward call where it is a backward one
    calls = Table({column: own[column][call.first] for column in ("rank", "step", "name", "api", "direction")})
    statistics = Table({"role": own["role"], "arg_index": own["arg_index"], "direction": own["direction"],
                        **{f"{column}_a": own[column] for column in ("norm", "min", "max", "mean", "shape")}})
    condition, rule = conditions(CallRecords(calls, statistics, call.codes))
    this = calls["direction"] == direction
    return float(condition[this][0]), str(rule[this][0]), str(calls["api"][this][0])


def _batch(console, name: str, step: int, paths: list[str], checksums: list[int]) -> int:
    """A batch is read, not computed: nothing to replay. Its checksums say whether the two runs
    were handed the same bits (-1: not recorded)."""
    console.print(f"{name} (step {step}) is the model's input: a batch is read, not computed, so it is not "
                  "replayed; its checksums tell whether the runs were handed the same bits")
    for label, path, checksum in zip("AB", paths, checksums):
        console.print(f"  {label} ({path}): checksum {checksum if checksum != -1 else 'not recorded'}")
    if len(checksums) < 2 or -1 in checksums:
        return 0
    same = checksums[0] == checksums[1]
    console.print("verdict: the same batch" if same else "verdict: the batches differ",
                  style="bold green" if same else "bold red")
    return 0 if same else 1
