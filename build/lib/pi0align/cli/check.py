"""`pi0align check RUN --baseline NAME`: a run against reference results (its loss curve, final
loss and throughput); `--save-baseline NAME` records a run as one.

Exit code: 0 passed (or recorded), 1 a criterion failed, 2 bad input.
"""

from __future__ import annotations

import argparse

from pi0align.cli.log_options import add_log_arguments, log_options


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", metavar="RUN", help="a run folder of `pi0align run`, or a log another tool left "
                                                   "(LeRobot's console log, TensorBoard events, CSV, JSON lines)")
    chosen = parser.add_mutually_exclusive_group(required=True)
    chosen.add_argument("--baseline", metavar="NAME", help="a baseline under baselines/, or its folder")
    chosen.add_argument("--save-baseline", metavar="NAME", help="record RUN as baselines/NAME")
    parser.add_argument("--baselines", metavar="DIR", default="baselines",
                        help="where baselines are (default: %(default)s)")
    parser.add_argument("--description", default="", help="with --save-baseline: how the run was made")
    criteria = parser.add_argument_group("criteria (default: the baseline's own)")
    criteria.add_argument("--tolerance", type=float, metavar="X", help="largest relative loss error per step")
    criteria.add_argument("--smooth", type=int, metavar="N", help="compare trailing means of N steps")
    criteria.add_argument("--final-tolerance", type=float, metavar="X", help="largest relative error of the final loss")
    criteria.add_argument("--min-throughput", type=float, metavar="F",
                          help="images/sec at least F × the baseline's, on the same device")
    add_log_arguments(parser)


def main(args: argparse.Namespace) -> int:
    import dataclasses

    from rich.console import Console

    from pi0align.report.runs.check_table import check_table
    from pi0align.runs.baselines import check, find_baseline, read_baseline, save_baseline
    from pi0align.runs.folder import read_run

    run = read_run(args.run, need_log=True, options=log_options(args))
    console = Console()
    given = {name: getattr(args, name) for name in ("tolerance", "smooth", "final_tolerance", "min_throughput")
             if getattr(args, name) is not None}
    if args.save_baseline:
        from pi0align.runs.baselines import BaselineCriteria

        saved = save_baseline(run, args.save_baseline, args.baselines, args.description, BaselineCriteria(**given))
        console.print(f"recorded {args.run} as baseline {args.save_baseline}: {saved}")
        return 0
    baseline = read_baseline(find_baseline(args.baseline, args.baselines))
    result = check(run, baseline, dataclasses.replace(baseline.criteria, **given))
    console.print(check_table(result))
    console.print("passed" if result else "failed", style="bold green" if result else "bold red")
    return 0 if result else 1
