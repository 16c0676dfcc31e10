"""`pi0align attach [options] -- COMMAND ...`: COMMAND run as it is, with pi0align loaded into every
Python process it starts (pi0align/attach/): the seed, the dumps and the monitor of `pi0align run`,
in a script nobody edits. Its output is passed through and kept in OUT/console.log (for `curves`).

Exit code: COMMAND's own; 2 for bad input, or when COMMAND built no torch optimizer to attach to.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import threading
from datetime import datetime
from pathlib import Path

from pi0align.cli.steps import parse_steps
from pi0align.dump.file_format import BACKENDS, LEVELS, MODES
from pi0align.runs.folder import CONSOLE_LOG

_LEFT_BEFORE = ("manifest.json", "train_log.jsonl", CONSOLE_LOG, "alerts.jsonl", "dump*.h5", "monitor*.h5")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=None, metavar="DIR",
                        help="folder of the dumps, monitor, manifest and logs (default: dumps/attach-<time>)")
    parser.add_argument("--seed", type=int, default=None, metavar="N",
                        help="seed_all(N) before the script's own code runs")
    parser.add_argument("--rm-dropout", action="store_true", help="with --seed: every dropout an identity")
    parser.add_argument("--threads", type=int, default=None, metavar="N", help="torch's CPU threads in each process")
    parser.add_argument("--dump-steps", type=parse_steps, default=None, metavar="0,10",
                        help="the optimizer steps to dump, counted from 0 (default: none)")
    parser.add_argument("--dump-level", choices=LEVELS, default="mix", help="(default: %(default)s)")
    parser.add_argument("--dump-mode", choices=MODES, default="stats", help="(default: %(default)s)")
    parser.add_argument("--dump-backend", choices=("auto", *BACKENDS), default="auto", help="(default: %(default)s)")
    parser.add_argument("--no-monitor", dest="monitor", action="store_false", help="no monitor.h5")
    parser.add_argument("--monitor-depth", type=int, default=None, metavar="N",
                        help="monitor the modules N levels deep (default: the blocks a person thinks in)")
    parser.add_argument("--model-attr", metavar="PATH",
                        help="watch this module: a dotted path from the module the first optimizer trains (`model` "
                             "for a LeRobot policy's network), or a global of the script")
    parser.add_argument("training_command", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                        help="the training command, as you would run it")


def main(args: argparse.Namespace) -> int:
    from pi0align.attach.settings import ENVIRONMENT, AttachSettings
    from pi0align.errors import UserError, check_writable

    command = args.training_command[1:] if args.training_command[:1] == ["--"] else args.training_command
    if not command:
        raise UserError("no command to attach to: pi0align attach [options] -- COMMAND ...")
    if shutil.which(command[0]) is None:
        raise UserError(f"{command[0]}: no such program")
    for name in ("threads", "monitor_depth"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1")
    if args.rm_dropout and args.seed is None:
        raise UserError("--rm-dropout goes with --seed (seed_all's)")
    out = (args.out or Path("dumps") / f"attach-{datetime.now():%Y%m%d-%H%M%S}").resolve()
    check_writable(out)
    out.mkdir(parents=True, exist_ok=True)
    for pattern in _LEFT_BEFORE:  # what an earlier attach left here: this one's files replace them
        for stale in out.glob(pattern):
            stale.unlink()
    settings = AttachSettings(
        out=str(out), command=tuple(command), seed=args.seed, rm_dropout=args.rm_dropout, threads=args.threads,
        dump_steps=tuple(args.dump_steps) if args.dump_steps is not None else None, dump_level=args.dump_level,
        dump_mode=args.dump_mode, dump_backend=args.dump_backend, monitor=args.monitor,
        monitor_depth=args.monitor_depth, model_attr=args.model_attr)
    site = Path(__file__).resolve().parent.parent / "attach" / "site"
    environment = dict(os.environ)
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, (str(site), environment.get("PYTHONPATH"))))
    environment[ENVIRONMENT] = settings.to_environment()
    if args.threads:
        environment["OMP_NUM_THREADS"] = str(args.threads)
    code = _run_teed(command, environment, out / CONSOLE_LOG)
    if not (out / "manifest.json").is_file():
        if code:
            return code  # it failed before it trained: its own message says why
        raise UserError(f"{' '.join(command)} built no torch optimizer: nothing to attach to (attach finds the model "
                        "through the first optimizer a process builds)")
    written = sorted(p.name for p in out.iterdir() if p.is_file())
    print(f"pi0align attach: wrote {', '.join(written)} to {out}", file=sys.stderr)
    return code


def _run_teed(command: list[str], environment: dict, log: Path) -> int:
    """Run `command`, its stdout and stderr passed through to ours and both kept in `log` as they
    come; an interrupt is passed on to it. Its exit code (128 + the signal's number when one ended it)."""
    process = subprocess.Popen(command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    lock = threading.Lock()

    with log.open("wb") as kept:
        def copy(source, target) -> None:
            for chunk in iter(lambda: source.read1(65536), b""):
                with lock:
                    target.write(chunk)
                    target.flush()
                    kept.write(chunk)

        copiers = [threading.Thread(target=copy, args=(source, target.buffer), daemon=True)
                   for source, target in ((process.stdout, sys.stdout), (process.stderr, sys.stderr))]
        for copier in copiers:
            copier.start()
        while True:
            try:
                code = process.wait()
                break
            except KeyboardInterrupt:
                process.send_signal(signal.SIGINT)
        for copier in copiers:
            copier.join()
    return code if code >= 0 else 128 - code
