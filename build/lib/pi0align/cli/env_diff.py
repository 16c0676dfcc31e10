"""`pi0align env-diff A B`: are two runs set up alike? Their manifests side by side, item by item.

Exit code: 0 nothing that changes the numbers differs, 1 something does, 2 bad input.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_a", metavar="A", help="a run folder, its manifest.json, or a dump (file or folder)")
    parser.add_argument("run_b", metavar="B", help="the same kinds as A")
    parser.add_argument("--all", action="store_true", help="list the items that are the same too")
    parser.add_argument("--json", metavar="PATH", type=Path, help="write every item (item, a, b, status, why)")


def main(args: argparse.Namespace) -> int:
    import dataclasses

    from rich.console import Console

    from pi0align.errors import UserError
    from pi0align.report.json_values import json_safe
    from pi0align.report.output import write_json_data
    from pi0align.report.runs.envdiff_table import env_diff_table, env_diff_verdict
    from pi0align.runs.envdiff import env_diff
    from pi0align.runs.folder import read_run

    runs = [read_run(path) for path in (args.run_a, args.run_b)]
    for run in runs:
        if not run.manifest:
            raise UserError(f"{run.path}: no manifest to compare (msprobe's dumps carry none)")
    diff = env_diff(runs[0].manifest, runs[1].manifest)
    console = Console()
    if diff.notable or args.all:
        console.print(env_diff_table(diff, title=f"set-up: A {args.run_a} · B {args.run_b}", show_same=args.all))
    console.print(env_diff_verdict(diff))
    if args.json:
        write_json_data(json_safe([dataclasses.asdict(line) for line in diff.lines]), args.json)
    return 0 if diff else 1
