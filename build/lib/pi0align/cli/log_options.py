"""The flags that say how another tool's log is read (runs/logs/), shared by the commands that read
runs' logs (`curves`, `check`)."""

from __future__ import annotations

import argparse


def add_log_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("other tools' logs (LeRobot's console log, TensorBoard, CSV, JSON lines)")
    group.add_argument("--loss-tag", metavar="TAG",
                       help="TensorBoard: the loss's scalar tag (default: the first of train/loss, loss, …)")
    group.add_argument("--columns", metavar="STEP,LOSS",
                       help="CSV and JSON lines: the step and loss columns (default: step and loss, or the like)")


def log_options(args: argparse.Namespace):
    from pi0align.errors import UserError
    from pi0align.runs.logs import LogOptions

    columns = None
    if args.columns is not None:
        columns = tuple(name.strip() for name in args.columns.split(","))
        if len(columns) != 2 or not all(columns):
            raise UserError(f"--columns takes two names, the step's and the loss's: STEP,LOSS (not {args.columns!r})")
    return LogOptions(loss_tag=args.loss_tag, columns=columns)
