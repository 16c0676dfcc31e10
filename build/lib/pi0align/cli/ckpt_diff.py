"""`pi0align ckpt-diff A B`: two checkpoints parameter by parameter (docs/runs.md).

Exit code: 0 every tensor within the tolerance, 1 one differs beyond it, 2 bad input.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("a", metavar="A", help="a run's checkpoints/NNNNNN/, its pretrained_model/, or a LeRobot "
                                               "policy folder (model.safetensors)")
    parser.add_argument("b", metavar="B", help="the same for the other checkpoint")
    parser.add_argument("--optimizer", action="store_true", help="the optimizer's states too (training_state.pt)")
    parser.add_argument("--tolerance", type=float, default=0.0, metavar="X",
                        help="largest relative L2 difference of a tensor (default: 0, bit for bit)")
    parser.add_argument("--json", metavar="PATH", help="write every tensor's difference")


def main(args: argparse.Namespace) -> int:
    import dataclasses

    from rich.console import Console

    from pi0align.errors import UserError, check_writable
    from pi0align.report.json_values import json_safe
    from pi0align.report.output import write_json_data
    from pi0align.report.runs.ckpt_table import ckpt_report
    from pi0align.runs.checkpoints import beyond, compare_checkpoints

    if not args.tolerance >= 0:
        raise UserError("--tolerance must be a number, at least 0")
    if args.json:
        check_writable(args.json)
    differences = compare_checkpoints(args.a, args.b, optimizer=args.optimizer)
    console = Console()
    console.print(ckpt_report(differences, args.tolerance, console.width))
    if args.json:
        written = write_json_data({"tolerance": args.tolerance,
                                   "tensors": [json_safe(dataclasses.asdict(d)) for d in differences]}, args.json)
        console.print(f"wrote {written}")
    return 1 if beyond(differences, args.tolerance) else 0
