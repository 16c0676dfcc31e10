"""`pi0align compare A B`: align two dumps, judge them, print the summary, write the reports.

Exit code: 0 aligned, 1 diverged, 2 bad input (one line on stderr).
"""

from __future__ import annotations

import argparse

from pi0align.cli.steps import parse_steps

EXIT_ALIGNED, EXIT_DIVERGED = 0, 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dump_a", metavar="A",
                        help="benchmark dump (e.g. GPU): a dump file, a run folder, or an msprobe dump folder")
    parser.add_argument("dump_b", metavar="B", help="dump under test (e.g. NPU), same kinds as A")
    outputs = parser.add_argument_group("outputs")
    outputs.add_argument("--csv", metavar="PATH", help="write every row (one per aligned pair or one-sided record)")
    outputs.add_argument("--json", metavar="PATH",
                         help="write verdict, coverage, first divergence, culprits, thresholds (docs/compare-json.md)")
    outputs.add_argument("--html", metavar="PATH", help="self-contained HTML report (default: reports/<A>-vs-<B>.html)")
    outputs.add_argument("--no-html", action="store_true", help="write no HTML report")
    outputs.add_argument("--top", metavar="N", type=int, default=10,
                         help="culprits shown in the console and atop the HTML report (default 10; --json lists all)")
    judging = parser.add_argument_group("judging")
    judging.add_argument("--thresholds", metavar="FILE",
                         help="JSON or TOML {dtype: {metric: value}} over the defaults (a --json output works too)")
    judging.add_argument("--threshold", metavar="DTYPE.METRIC=VALUE", action="append", default=[],
                         help="override one threshold, e.g. fp32.rel_l2_err=1e-5 (repeatable; wins over --thresholds)")
    judging.add_argument("--calibrate", metavar=("A1", "A2"), nargs=2,
                         help="thresholds from the noise floor of two same-seed runs on one device "
                              "(over --thresholds; --threshold still wins)")
    judging.add_argument("--noise", metavar="REF",
                         help="noise reference: A's run again with every result moved by an ulp "
                              "(`pi0align run --perturb-ulps 1`); each record's limits follow how far REF is from A")
    judging.add_argument("--no-replay", action="store_true",
                         help="do not replay calls in float64 (replay runs where both dumps hold full tensors)")
    parser.add_argument("--steps", type=parse_steps,
                        help="compare only these steps, e.g. 0,3,5-7 (default: every step both dumps hold)")


def main(args: argparse.Namespace) -> int:
    # Imported here, not at the top: `pi0align compare --help` stays instant (numpy, h5py, rich);
    # the HTML report's modules (Jinja2) only when it is written.
    from rich.console import Console

    from pi0align.compare import calibrate, compare_dumps, load_thresholds, parse_overrides
    from pi0align.errors import UserError, check_writable
    from pi0align.report import print_summary, progress_bar, write_csv, write_json

    if args.top < 0:
        raise UserError("--top must be 0 or more")
    if args.html and args.no_html:
        raise UserError("--html and --no-html contradict each other; give one")
    for output in (args.csv, args.json, args.html):
        if output:
            check_writable(output)  # said now, not after a long compare
    if not args.no_html:
        from pi0align.report import plotly_js

        plotly_js()  # a missing plotly is said now, not after a long compare
    # no emoji codes: a name like `x:fire:` is printed as it is
    console, status = Console(emoji=False), Console(stderr=True, emoji=False)
    # Precedence, lowest first: defaults, --thresholds FILE, --calibrate, --threshold overrides.
    overrides = parse_overrides(args.threshold)
    thresholds = load_thresholds(args.thresholds)
    if args.calibrate:
        status.print("calibrating thresholds from the noise floor of " + " and ".join(args.calibrate), highlight=False)
        thresholds = calibrate(*args.calibrate, steps=args.steps, base=thresholds)
    thresholds = load_thresholds(None, overrides, base=thresholds)
    with progress_bar(status, "comparing") as progress:
        comparison = compare_dumps(args.dump_a, args.dump_b, thresholds=thresholds, steps=args.steps,
                                   progress=progress, noise=args.noise, replay=not args.no_replay)

    written = []  # the files first: what the console cannot print is still in them
    if args.csv:
        written.append(write_csv(comparison, args.csv))
    if args.json:
        written.append(write_json(comparison, args.json))
    if not args.no_html:
        from pi0align.report import default_html_path, write_html

        html_path = args.html or default_html_path(args.dump_a, args.dump_b)
        written.append(write_html(comparison, html_path, top=args.top))
    print_summary(comparison, console, top=args.top)
    for path in written:
        console.print(f"wrote {path}", highlight=False)
    return EXIT_ALIGNED if comparison.verdict == "aligned" else EXIT_DIVERGED
