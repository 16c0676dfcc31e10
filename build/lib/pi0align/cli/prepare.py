"""`pi0align prepare OUT`: fetch PI0's weights, PaliGemma's tokenizer and a dataset; `--check` verifies offline."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pi0align.pi0 import prepare

    parser.description = (parser.description or "") + "\n\n" + prepare.__doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("out", type=Path, help="folder for the three artifacts")
    parser.add_argument("--check", action="store_true", help="only verify an existing folder, offline")
    parser.add_argument("--dataset-repo", default="lerobot/koch_test", help="dataset to fetch (default: %(default)s)")


def main(args) -> int:
    from pi0align.pi0 import prepare

    if args.check:
        folders = prepare.check(args.out, args.dataset_repo)
    else:
        args.out.mkdir(parents=True, exist_ok=True)
        folders = prepare.fetch(args.out, args.dataset_repo)
    print(f"{args.out}: weights, tokenizer and dataset present")
    print(f"pi0align run {prepare.run_flags(folders)}")
    return 0
