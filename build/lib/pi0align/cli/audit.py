"""`pi0align audit DUMP`: one run judged alone: where its first NaN/Inf came from and, with full
tensors, each call against float64 (docs/audit.md).

Exit code: 0 pass, 1 a culprit (a NaN/Inf made, or a call beyond its standard), 2 bad input.
"""

from __future__ import annotations

import argparse

from pi0align.cli.steps import parse_steps


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dump", metavar="DUMP", help="a dump file, a run folder, or an msprobe dump folder")
    parser.add_argument("--json", metavar="PATH", help="write the verdict, culprits, groups and edges (docs/audit.md)")
    parser.add_argument("--html", metavar="PATH", help="write a self-contained HTML page")
    parser.add_argument("--top", metavar="N", type=int, default=10, help="culprits shown (default 10; --json: all)")
    parser.add_argument("--steps", type=parse_steps, help="only these steps, e.g. 0,3,5-7 (default: every step)")
    parser.add_argument("--no-replay", action="store_true",
                        help="NaN and Inf only: do not replay the calls of a full-tensor dump in float64")


def main(args: argparse.Namespace) -> int:
    from rich.console import Console

    from pi0align.auditing import audit
    from pi0align.errors import UserError, check_writable
    from pi0align.report.audit.audit_console import print_audit
    from pi0align.report.comparison.console import progress_bar
    from pi0align.report.formatting import ShortNames

    if args.top < 0:
        raise UserError("--top must be 0 or more")
    for output in (args.json, args.html):
        if output:
            check_writable(output)
    console = Console(emoji=False)
    with progress_bar(Console(stderr=True, emoji=False), "replaying") as progress:
        result = audit(args.dump, steps=args.steps, replay=not args.no_replay, progress=progress)
    written = []  # the files first: what the console cannot print is still in them
    if args.json:
        from pi0align.report.audit.audit_json import write_audit_json

        written.append(write_audit_json(result, args.json))
    if args.html:
        from pi0align.report.audit.audit_page import write_audit_html

        written.append(write_audit_html(result, args.html, top=args.top))
    names = ShortNames(culprit.module for culprit in result.culprits)
    print_audit(result, console, names, top=args.top)
    for path in written:
        console.print(f"wrote {path}", highlight=False)
    return 0 if result.verdict == "pass" else 1
