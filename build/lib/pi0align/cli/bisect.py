"""`pi0align bisect A B`: the first of A's checkpoints from which this device computes a different
step, and the call that does it (docs/bisect.md).

Exit code: 0 no step computes differently, 1 one does, 2 bad input (one line).
"""

from __future__ import annotations

import argparse

from pi0align.runs.curves import TOLERANCE


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("reference", metavar="A", help="the reference run's folder, with checkpoints (--save-every)")
    parser.add_argument("under_test", metavar="B",
                        help="the run under test's folder (its log at least), on this device")
    parser.add_argument("--out", metavar="DIR", help="where the probes go; a bisect run again there resumes "
                                                     "(default: B/bisect)")
    parser.add_argument("--tolerance", type=float, default=TOLERANCE, metavar="X",
                        help="relative loss error where B's curve leaves A's band, which bounds the checkpoints "
                             "searched (default: %(default)s, as curves)")
    parser.add_argument("--device", metavar="D", help="the device the probes run on (default: B's, from its manifest)")
    parser.add_argument("--json", metavar="PATH", help="write the probes, the checkpoint found and the culprit")


def main(args: argparse.Namespace) -> int:
    from rich.console import Console

    from pi0align.bisecting import bisect
    from pi0align.errors import UserError, check_writable
    from pi0align.report.bisect.bisect_console import print_bisection, probe_line

    if not args.tolerance >= 0:
        raise UserError("--tolerance must be a number, at least 0")
    if args.device is not None and args.device.partition(":")[0] not in ("cpu", "cuda", "npu"):
        raise UserError(f"unknown device {args.device!r}: choose one of cpu, cuda, npu (cuda:1, npu:0)")
    if args.json:
        check_writable(args.json)
    console = Console(emoji=False)
    with console.status("reading the runs") as status:  # drawn on a terminal only
        result = bisect(args.reference, args.under_test, out=args.out, tolerance=args.tolerance, device=args.device,
                        report=lambda probe, bound: console.print(probe_line(probe, bound)),
                        starting=lambda step, kind: status.update(f"one step from step {step} ({kind})"))
    if args.json:
        from pi0align.report.bisect.bisect_json import write_bisection_json

        console.print(f"wrote {write_bisection_json(result, args.json)}", highlight=False)
    print_bisection(result, console)
    return 1 if result.first_checkpoint_beyond is not None else 0
