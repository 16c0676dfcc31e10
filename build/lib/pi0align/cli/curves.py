"""`pi0align curves RUN...`: loss curves of runs side by side, each against the first; with
`--modules`, every monitored module's trends too, and where they first part. A run is a folder of
`pi0align run` or a log another tool left (LeRobot's console log, TensorBoard events, CSV or JSON
lines): a log of means over windows of steps is compared over its windows.

Exit code: 0 every run within the tolerance (bit for bit with --exact; and every module within the
band with --modules), 1 one is not, 2 bad input.
"""

from __future__ import annotations

import argparse

from pi0align.cli.log_options import add_log_arguments, log_options
from pi0align.runs.curves import TOLERANCE
from pi0align.runs.monitor import BAND


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", metavar="RUN", nargs="+",
                        help="run folders, or logs other tools left (the first is the reference)")
    parser.add_argument("--tolerance", type=float, default=TOLERANCE, metavar="X",
                        help="largest relative loss error per step (default: %(default)s, a port's usual line)")
    parser.add_argument("--smooth", type=int, default=1, metavar="N",
                        help="compare trailing means of N steps (default: %(default)s, the raw losses)")
    parser.add_argument("--exact", action="store_true", help="every loss must hold the same bits")
    parser.add_argument("--modules", action="store_true",
                        help="every monitored module's quantities too (the runs' monitor.h5), and which leaves the "
                             "band first")
    parser.add_argument("--band", type=float, default=BAND, metavar="X",
                        help="with --modules: largest relative difference of a module's quantity "
                             "(default: %(default)s)")
    parser.add_argument("--html", metavar="PATH", help="write the curves overlaid (with --modules, a heat map over "
                                                       "step × module), as a self-contained page")
    parser.add_argument("--json", metavar="PATH", help="write each comparison: the loss's, and with --modules each "
                                                       "module quantity's first step outside and `first_outside`")
    parser.add_argument("--tensorboard", metavar="DIR", help="write the runs' logs and monitors as TensorBoard "
                                                            "scalars, a folder per run")
    add_log_arguments(parser)


def main(args: argparse.Namespace) -> int:
    from rich.console import Console

    from pi0align.errors import UserError, check_writable
    from pi0align.report.runs.curves_table import curves_table
    from pi0align.runs.curves import compare_curves, load_runs

    if args.smooth < 1:
        raise UserError("--smooth must be at least 1")
    for name in ("tolerance", "band"):
        if not getattr(args, name) >= 0:
            raise UserError(f"--{name} must be a number, at least 0")
    for output in (args.html, args.json):
        if output:
            check_writable(output)
    frame = load_runs(args.runs, log_options(args))
    comparison = compare_curves(frame, tolerance=args.tolerance, smooth=args.smooth, exact=args.exact)
    monitor = modules = None
    if args.modules:
        from pi0align.runs.monitor import compare_modules, load_monitor

        monitor = load_monitor(args.runs)
        modules = compare_modules(monitor, band=args.band)
    console = Console()
    console.print(curves_table(frame, comparison))
    if modules is not None:
        from pi0align.report.runs.modules_table import modules_report

        console.print(modules_report(modules, comparison, console.width))
    if args.html:
        from pi0align.report.runs.curves_page import write_curves_html

        console.print(f"wrote {write_curves_html(frame, comparison, args.html, modules, monitor)}")
    if args.json:
        from pi0align.report.runs.curves_json import write_curves_json

        console.print(f"wrote {write_curves_json(comparison, modules, args.json)}")
    if args.tensorboard:
        from pi0align.report.runs.tensorboard import write_tensorboard
        from pi0align.runs.monitor import load_monitor

        if monitor is None:
            monitor = load_monitor(args.runs, missing_ok=True)
        console.print(f"wrote {write_tensorboard(frame, monitor, args.tensorboard)}")
    return 0 if comparison and (modules is None or modules) else 1
