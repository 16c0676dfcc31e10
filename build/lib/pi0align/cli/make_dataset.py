"""`pi0align make-dataset OUT`: a synthetic koch-like LeRobot dataset, written by LeRobot's writer."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", type=Path, help="new folder for the dataset")
    parser.add_argument("--episodes", type=int, default=4, help="(default: %(default)s)")
    parser.add_argument("--frames", type=int, default=40, help="frames per episode (default: %(default)s)")
    parser.add_argument("--fps", type=int, default=30, help="(default: %(default)s)")
    parser.add_argument("--height", type=int, default=48, help="camera image height (default: %(default)s)")
    parser.add_argument("--width", type=int, default=64, help="camera image width (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")


def main(args) -> int:
    import datasets

    from pi0align.errors import UserError
    from pi0align.pi0.dataset import fingerprint, make_synthetic_dataset

    if min(args.episodes, args.frames, args.fps, args.height, args.width) < 1:
        raise UserError("--episodes, --frames, --fps, --height and --width must be at least 1")
    datasets.disable_progress_bars()
    root = make_synthetic_dataset(args.out, episodes=args.episodes, frames_per_episode=args.frames, fps=args.fps,
                                  height=args.height, width=args.width, seed=args.seed)
    print(f"wrote {args.episodes * args.frames} frames in {args.episodes} episodes to {root}")
    print(f"fingerprint: {fingerprint(root)}")
    return 0
