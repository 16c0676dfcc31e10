"""`pi0align curves RUN...`: loss curves of runs side by side, each against the first.

Exit code: 0 every run within the tolerance (bit for bit with --exact), 1 one is not, 2 bad input.
"""

from __future__ import annotations

import argparse

from pi0align.runs.curves import TOLERANCE


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", metavar="RUN", nargs="+", help="run folders (the first is the reference)")
    parser.add_argument("--tolerance", type=float, default=TOLERANCE, metavar="X",
                        help="largest relative loss error per step (default: %(default)s, a port's usual line)")
    parser.add_argument("--smooth", type=int, default=1, metavar="N",
                        help="compare trailing means of N steps (default: %(default)s, the raw losses)")
    parser.add_argument("--exact", action="store_true", help="every loss must hold the same bits")
    parser.add_argument("--html", metavar="PATH", help="write the curves overlaid, as a self-contained page")


def main(args: argparse.Namespace) -> int:
    from rich.console import Console

    from pi0align.errors import UserError
    from pi0align.report.curves_table import curves_table
    from pi0align.runs.curves import compare_curves, load_runs

    if args.smooth < 1:
        raise UserError("--smooth must be at least 1")
    if not args.tolerance >= 0:
        raise UserError("--tolerance must be a number, at least 0")
    frame = load_runs(args.runs)
    comparison = compare_curves(frame, tolerance=args.tolerance, smooth=args.smooth, exact=args.exact)
    console = Console()
    console.print(curves_table(frame, comparison))
    if args.html:
        from pi0align.report.curves_page import write_curves_html

        console.print(f"wrote {write_curves_html(frame, comparison, args.html)}")
    return 0 if comparison else 1
