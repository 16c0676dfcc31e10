"""`pi0align run`: seeded PI0 training, optionally dumping tensors at chosen steps."""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING

from pi0align.cli.steps import parse_steps
from pi0align.dump.file_format import BACKENDS, LEVELS, MODES
from pi0align.errors import UserError, check_writable

if TYPE_CHECKING:  # imported where the flags are made (add_arguments), as every command imports only its own
    from pi0align.train.config import TrainConfig

SECTIONS = {"run": "run", "inputs": "inputs (all local; nothing is downloaded)", "seeding": "seeding",
            "scale": "processes, profiling and tuning"}
_TYPES = {"int": int, "int | None": int, "float | None": float, "str": str, "Path | None": Path, "str | None": str}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of every TrainConfig field, made from the field, then --resume and the dump's."""
    from pi0align.train.config import CHOICES, TrainConfig, flag_name

    defaults = TrainConfig()
    sections = {key: parser.add_argument_group(title) for key, title in SECTIONS.items()}
    for field in dataclasses.fields(TrainConfig):
        meta, default = field.metadata, getattr(defaults, field.name)
        section = sections[meta["group"]]
        if meta["negation"]:
            section.add_argument(meta["negation"], dest=field.name, action="store_false", help=meta["help"])
            continue
        if field.type == "bool":  # off by default: its flag turns it on
            section.add_argument(f"--{flag_name(field.name)}", dest=field.name, action="store_true", default=None,
                                 help=meta["help"])
            continue
        shown = "" if default is None else f" (default: {default})"
        # None: not given, the config's default (or, with --resume, the resumed run's)
        choices = [choice for choice in CHOICES.get(field.name, ()) if choice is not None] or None  # None: not given
        section.add_argument(f"--{flag_name(field.name)}", dest=field.name, type=_TYPES[field.type], default=None,
                             choices=choices, metavar=meta["metavar"], help=meta["help"] + shown)
    sections["run"].add_argument("--resume", type=Path, default=None, metavar="DIR",
                                 help="continue a run from its folder or one of its checkpoints; its config is "
                                      "reused (--steps and --no-progress apply)")
    sections["run"].add_argument("--from", dest="from_run", type=Path, default=None, metavar="RUN",
                                 help="start from another run's checkpoint at --at: its config, weights, optimizer, "
                                      "scheduler, RNG states and batch order, on this run's --device and --threads; "
                                      "--steps counts the steps to run (default 1)")
    sections["run"].add_argument("--at", type=int, default=None, metavar="STEP",
                                 help="with --from: the step to start at (RUN's checkpoints/STEP, saved after STEP "
                                      "steps: run RUN with --save-every)")
    dump = parser.add_argument_group("dump")
    dump.add_argument("--dump-steps", type=parse_steps, default=None, metavar="0,10",
                      help="steps to dump (0-based), e.g. 0,10 or 0-3; none by default")
    dump.add_argument("--dump-level", choices=LEVELS, default="mix", help="(default: %(default)s)")
    dump.add_argument("--dump-mode", choices=MODES, default="stats", help="(default: %(default)s)")
    dump.add_argument("--dump-backend", choices=("auto", *BACKENDS), default="auto",
                      help="native: C++ hooks and CPU statistics kernel; torch: torch ops only, what accelerators "
                           "run; auto: native where it builds (default: %(default)s)")
    dump.add_argument("--dump-include", action="append", default=[], metavar="PATTERN", help="only matching names")
    dump.add_argument("--dump-exclude", action="append", default=[], metavar="PATTERN", help="skip matching names")
    dump.add_argument("--perturb-ulps", type=int, default=0, metavar="N",
                      help="make this run a noise reference for `compare --noise`: move every floating result by "
                           "up to N ulps at random (seeded by --seed); not a run to keep")


@dataclasses.dataclass(frozen=True)
class Start:
    """How a run starts: its config, the checkpoint of its own it resumes, another run's it starts
    from, and the step it stops at (None: the config's steps)."""

    config: object
    resume_from: Path | None = None
    started_from: Path | None = None
    stop_step: int | None = None


# what a run started --from another may set: where and how it runs, not what it computes
_FROM_FIELDS = ("device", "threads", "out", "progress", "log_every", "num_workers", "monitor", "monitor_depth",
                "dump_on_alert")
# the run folder's dump (Dumper.file names each rank's after it: dump-rank<R>.h5 on several processes)
DUMP_FILE = Path("dump.h5")


def start_from_args(args) -> Start:
    from pi0align.train import checkpoint
    from pi0align.train.config import TrainConfig, flag_name

    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)
             if getattr(args, f.name) is not None and not (f.metadata["negation"] and getattr(args, f.name))}
    if args.from_run is not None:
        if args.resume is not None:
            raise UserError("--from starts a new run from another's checkpoint, --resume continues one: not both")
        if args.at is None:
            raise UserError("--from needs --at STEP: the step of the other run to start at")
        source = checkpoint.checkpoint_dir(args.from_run, args.at)
        if not (source / checkpoint.TRAINING_STATE).is_file():
            raise UserError(f"{args.from_run} has no checkpoint after {args.at} steps ({source}): run it with "
                            f"--save-every so that one is saved there")
        config = checkpoint.load_config(source)
        # a flag may repeat the run's own value (a command line copied from it), not change it
        fixed = [name for name in given
                 if name not in (*_FROM_FIELDS, "steps") and given[name] != getattr(config, name)]
        if fixed:
            raise UserError(f"--from runs {args.from_run}'s configuration: --{flag_name(fixed[0])} cannot change it "
                            f"(only {', '.join('--' + flag_name(n) for n in _FROM_FIELDS)} can)")
        stop = args.at + (args.steps or 1)
        if stop > config.steps:
            raise UserError(f"{args.from_run} ran {config.steps} steps: --at {args.at} with --steps {args.steps or 1} "
                            f"runs past them")
        config = dataclasses.replace(config, **{"out": None, **{name: given[name] for name in _FROM_FIELDS
                                                                if name in given}})
        return Start(config, started_from=source, stop_step=stop)
    if args.at is not None:
        raise UserError("--at is the step of another run to start at: it goes with --from")
    if args.resume is not None:
        resume_from = checkpoint.resolve(args.resume)
        config = checkpoint.load_config(resume_from)
        steps = args.steps if args.steps is not None else config.steps
        config = dataclasses.replace(config, out=resume_from.parent.parent, steps=steps, progress=args.progress)
        dumps = sorted(config.out.glob(f"{DUMP_FILE.stem}*{DUMP_FILE.suffix}"))
        if args.dump_steps is not None and dumps:
            raise UserError(f"{dumps[0]} holds the steps this run dumped before: a resumed run dumping into its "
                            f"folder would write over them (move {', '.join(d.name for d in dumps)} out of "
                            f"{config.out} first, or resume without --dump-steps)")
        return Start(config, resume_from=resume_from)
    from pi0align.train.config import RECIPES

    return Start(TrainConfig(**{**RECIPES.get(given.get("recipe"), {}), **given}))


def make_dumper(args, out: Path, seed: int):
    if args.perturb_ulps < 0:
        raise UserError("--perturb-ulps must not be negative")
    if args.dump_steps is None:
        if args.perturb_ulps:
            raise UserError("--perturb-ulps makes a noise reference to compare against: it needs --dump-steps")
        return None
    from pi0align.dump import Dumper

    return Dumper(out / DUMP_FILE, steps=args.dump_steps, level=args.dump_level, mode=args.dump_mode,
                  include=args.dump_include or None, exclude=args.dump_exclude or None,
                  perturb_ulps=args.perturb_ulps, perturb_seed=seed, backend=args.dump_backend)


def make_monitor(config: TrainConfig, dumper):
    """The run's monitor (every module at every step, dump/monitoring/monitor.py) with its alert rules, and
    the dumps of the steps after its alerts (`--dump-on-alert`); (None, None) with --no-monitor."""
    if not config.monitor:
        if config.dump_on_alert:
            raise UserError("--dump-on-alert dumps the step after a monitor's alert: it needs the monitor (drop "
                            "--no-monitor)")
        return None, None
    from pi0align.dump.monitoring.alert_dumps import AlertDumps
    from pi0align.dump.monitoring.alerts import AlertRules
    from pi0align.dump.monitoring.monitor import Monitor

    monitor = Monitor(config.out, depth=config.monitor_depth, alerts=AlertRules())
    return monitor, AlertDumps(config.out, dumper) if config.dump_on_alert else None


def main(args) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing downloads at run time
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from pi0align.train.loop import default_out_dir

    # the flags are checked before the slow imports below: a bad one fails at once
    start = start_from_args(args)
    config = start.config
    from pi0align.train import distributed

    launched = distributed.launched().distributed
    if config.nproc > 1 and not launched:
        from pi0align.train.loop import check_inputs

        check_inputs(config)  # a bad input is one line here, not one per process
        # every process writes to one folder: named here, once
        out = Path(config.out or default_out_dir(config))
        check_writable(out)
        return distributed.launch([*args.argv, *([] if config.out is not None else ["--out", str(out)])], config.nproc)
    if launched and config.out is None:
        raise UserError("under a launcher every process writes to one run folder: give --out DIR")
    config.out = Path(config.out or default_out_dir(config))
    check_writable(config.out)
    dumper = make_dumper(args, config.out, config.seed)
    monitor, alert_dumps = make_monitor(config, dumper)

    import datasets
    import transformers

    from pi0align.train.log import summary_lines
    from pi0align.train.loop import train

    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    summary = train(config, dumper=dumper, resume_from=start.resume_from, started_from=start.started_from,
                    stop_step=start.stop_step, monitor=monitor, alert_dumps=alert_dumps)
    if distributed.launched().main:  # once, for every rank
        for line in summary_lines(summary):
            print(line)
        print(f"run folder: {summary['out']}")
    return 0
