"""`pi0align doctor`: this machine against the supported versions and the switches comparable
runs need (docs/supported-versions.md).

Exit code: 0 all supported, 1 a mismatch.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", metavar="PATH", help="write every finding (check, found, wanted, status, hint)")


def main(args: argparse.Namespace) -> int:
    import dataclasses

    from rich.console import Console

    from pi0align.report.output import write_json_data
    from pi0align.report.runs.doctor_table import doctor_report
    from pi0align.runs.supported import doctor, this_machine

    result = doctor(this_machine())
    Console().print(doctor_report(result))
    if args.json:
        write_json_data([dataclasses.asdict(finding) for finding in result.findings], args.json)
    return 0 if result else 1
