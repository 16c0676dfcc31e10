"""The one grammar of step lists, for every command's flags: `0,3,5-7`."""

from __future__ import annotations

import argparse


def parse_steps(text: str) -> list[int]:
    """`"0,3,5-7"` -> `[0, 3, 5, 6, 7]`: step numbers and upward ranges, comma-separated (an
    argparse `type`: a bad list is the command's one-line usage error)."""
    steps: set[int] = set()
    try:
        for part in text.split(","):
            first, _, last = part.strip().partition("-")
            steps.update(range(int(first), int(last or first) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of steps such as 0,3,5-7") from None
    if not steps:
        raise argparse.ArgumentTypeError(f"{text!r} names no step (a range must go upwards, as in 5-7)")
    return sorted(steps)
