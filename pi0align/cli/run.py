"""`pi0align run`: seeded PI0 training, optionally dumping tensors at chosen steps."""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

from pi0align.cli.steps import parse_steps
from pi0align.errors import UserError

DUMP_LEVELS = ("api", "module", "mix")
DUMP_MODES = ("stats", "sample", "tensor")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pi0align.train.config import TrainConfig

    defaults = TrainConfig()
    run = parser.add_argument_group("run")
    run.add_argument("--device", default=defaults.device, help="cpu, cuda[:N] or npu[:N] (default: %(default)s)")
    run.add_argument("--seed", type=int, default=defaults.seed,
                     help="seed for every random source (default: %(default)s)")
    run.add_argument("--preset", choices=("full", "small", "tiny"), default=defaults.preset,
                     help="model size; small presets keep PI0's architecture (default: %(default)s)")
    run.add_argument("--dtype", choices=("fp32", "bf16"), default=defaults.dtype, help="(default: %(default)s)")
    run.add_argument("--steps", type=int, default=None, help=f"optimizer steps (default: {defaults.steps})")
    run.add_argument("--batch-size", type=int, default=defaults.batch_size, help="(default: %(default)s)")
    run.add_argument("--lr", type=float, default=None, help="peak learning rate (default: PI0's preset, 2.5e-5)")
    run.add_argument("--num-workers", type=int, default=defaults.num_workers,
                     help="dataloader workers (default: %(default)s)")
    run.add_argument("--threads", type=int, default=defaults.threads, help="torch CPU threads (default: %(default)s)")
    run.add_argument("--log-every", type=int, default=defaults.log_every, help="console line every N steps; 0: none")
    run.add_argument("--save-every", type=int, default=defaults.save_every,
                     help="checkpoint every N steps; 0: only at the end")
    run.add_argument("--out", type=Path, default=None, help="run folder (default: dumps/<device>-seed<seed>-<time>/)")
    run.add_argument("--resume", type=Path, default=None, metavar="DIR",
                     help="continue a run from its folder or one of its checkpoints; its config is reused")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    inputs = parser.add_argument_group("inputs (all local; nothing is downloaded)")
    inputs.add_argument("--dataset", type=Path, default=None, metavar="ROOT",
                        help="local LeRobot dataset (default: built-in synthetic koch-like dataset)")
    inputs.add_argument("--tokenizer", type=Path, default=None, metavar="DIR",
                        help="PaliGemma tokenizer folder (required by --preset full)")
    inputs.add_argument("--pretrained", type=Path, default=None, metavar="DIR",
                        help="LeRobot policy folder with model.safetensors (e.g. lerobot/pi0)")
    seeding = parser.add_argument_group("seeding")
    seeding.add_argument("--seed-impl", choices=("msprobe", "pi0align"), default=defaults.seed_impl,
                         help="msprobe: msprobe's seed_all when installed, else ours (default: %(default)s)")
    seeding.add_argument("--no-deterministic", action="store_true", help="allow non-deterministic algorithms")
    seeding.add_argument("--keep-dropout", action="store_true", help="leave dropout active")
    dump = parser.add_argument_group("dump")
    dump.add_argument("--dump-steps", type=parse_steps, default=None, metavar="0,10",
                      help="steps to dump (0-based), e.g. 0,10 or 0-3; none by default")
    dump.add_argument("--dump-level", choices=DUMP_LEVELS, default="mix", help="(default: %(default)s)")
    dump.add_argument("--dump-mode", choices=DUMP_MODES, default="stats", help="(default: %(default)s)")
    dump.add_argument("--dump-include", action="append", default=[], metavar="PATTERN", help="only matching names")
    dump.add_argument("--dump-exclude", action="append", default=[], metavar="PATTERN", help="skip matching names")
    dump.add_argument("--perturb-ulps", type=int, default=0, metavar="N",
                      help="make this run a noise reference for `compare --noise`: move every floating result by "
                           "up to N ulps at random (seeded by --seed); not a run to keep")


def config_from_args(args):
    from pi0align.train import checkpoint
    from pi0align.train.config import TrainConfig

    if args.resume is not None:
        resume_from = checkpoint.resolve(args.resume)
        config = checkpoint.load_config(resume_from)
        steps = args.steps if args.steps is not None else config.steps
        config = dataclasses.replace(config, out=resume_from.parent.parent, steps=steps, progress=not args.no_progress)
        return config, resume_from
    config = TrainConfig(
        device=args.device, seed=args.seed, preset=args.preset, dtype=args.dtype,
        steps=args.steps if args.steps is not None else TrainConfig.steps,
        batch_size=args.batch_size, lr=args.lr, num_workers=args.num_workers, threads=args.threads,
        log_every=args.log_every, save_every=args.save_every, out=args.out, dataset=args.dataset,
        tokenizer=args.tokenizer, pretrained=args.pretrained, seed_impl=args.seed_impl,
        deterministic=not args.no_deterministic, rm_dropout=not args.keep_dropout, progress=not args.no_progress,
    )
    return config, None


def make_dumper(args, out: Path, seed: int):
    if args.perturb_ulps < 0:
        raise UserError("--perturb-ulps must not be negative")
    if args.dump_steps is None:
        if args.perturb_ulps:
            raise UserError("--perturb-ulps makes a noise reference to compare against: it needs --dump-steps")
        return None
    from pi0align.dump import Dumper

    return Dumper(out / "dump.h5", steps=args.dump_steps, level=args.dump_level, mode=args.dump_mode,
                  include=args.dump_include or None, exclude=args.dump_exclude or None,
                  perturb_ulps=args.perturb_ulps, perturb_seed=seed)


def main(args) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing downloads at run time
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from pi0align.train.loop import default_out_dir

    # the flags are checked before the slow imports below: a bad one fails at once
    config, resume_from = config_from_args(args)
    config.out = Path(config.out or default_out_dir(config))
    dumper = make_dumper(args, config.out, config.seed)

    import datasets
    import transformers

    from pi0align.train.log import summary_lines
    from pi0align.train.loop import train

    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    summary = train(config, dumper=dumper, resume_from=resume_from)
    for line in summary_lines(summary):
        print(line)
    print(f"run folder: {summary['out']}")
    return 0
