"""`pi0align` entry point: parse, dispatch to one command module, turn user errors into one line.

Command modules are imported only when their command runs, so `pi0align compare` never pays
for importing torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from pi0align.errors import UserError
from pi0align.version import __version__

DESCRIPTION = """\
Precision alignment of LeRobot PI0 training across devices (an NPU against a
GPU): train with every random source fixed and dump tensors, then find at which
step, in which call and on which side two runs part."""
EXAMPLES = """\
examples:
  pi0align run --preset tiny --steps 20 --dump-steps 0,10
  pi0align env-diff dumps/gpu dumps/npu
  pi0align compare dumps/gpu dumps/npu
  pi0align curves dumps/gpu dumps/npu --html reports/curves.html
  pi0align replay dumps/gpu 'model.layers.1.mlp/Functional.gelu#0' \\
      --against dumps/npu

'pi0align COMMAND --help' tells more; the README lists every flag."""
# command -> (module, one-line help). Each module has add_arguments(parser) and main(args) -> int.
COMMANDS = {
    "run": ("pi0align.cli.run", "train LeRobot PI0 with every random source fixed, optionally dumping tensors"),
    "attach": ("pi0align.cli.attach", "run a training command nobody edits (lerobot-train, torchrun, accelerate "
                                      "launch …) with the dumps, the monitor and the seed of `run`"),
    "make-dataset": ("pi0align.cli.make_dataset", "write a synthetic koch-like LeRobot dataset"),
    "prepare": ("pi0align.cli.prepare", "fetch or check the weights, tokenizer and dataset a real run needs"),
    "compare": ("pi0align.cli.compare", "align two dumps, measure, judge and name the call that introduced the error"),
    "replay": ("pi0align.cli.replay", "replay one dumped call in float64 and print each side's local error"),
    "audit": ("pi0align.cli.audit", "one run judged alone: where its first NaN/Inf came from, each call against "
                                    "float64"),
    "bisect": ("pi0align.cli.bisect", "from where two runs' curves part to the step and the call that computes "
                                      "differently"),
    "env-diff": ("pi0align.cli.env_diff", "are two runs set up alike: versions, switches, config, weights, data"),
    "curves": ("pi0align.cli.curves", "loss curves of runs side by side, and where they part"),
    "ckpt-diff": ("pi0align.cli.ckpt_diff", "two checkpoints parameter by parameter (and their optimizer states)"),
    "check": ("pi0align.cli.check", "a run against a baseline's curve, final loss and throughput"),
    "doctor": ("pi0align.cli.doctor", "this machine against the supported versions and switches"),
    "hostfile": ("pi0align.cli.hostfile", "a DeepSpeed hostfile and launch commands for training across nodes"),
}


def build_parser(argv: list[str]) -> tuple[argparse.ArgumentParser, object | None]:
    parser = argparse.ArgumentParser(prog="pi0align", description=DESCRIPTION, epilog=EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"pi0align {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = next((a for a in argv if not a.startswith("-")), None)
    module = None
    for command, (module_name, help_text) in COMMANDS.items():
        sub = subparsers.add_parser(command, help=help_text, description=help_text)
        if command == chosen:
            module = importlib.import_module(module_name)
            module.add_arguments(sub)
    return parser, module


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser, module = build_parser(argv)
    args = parser.parse_args(argv)
    args.argv = list(argv)  # as given: a command may run itself again (run --nproc, under a launcher)
    if module is None:
        parser.print_help()
        return 2
    try:
        return int(module.main(args) or 0)
    except UserError as error:
        print(f"pi0align {args.command}: error: {error}", file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt:
        print(f"pi0align {args.command}: interrupted", file=sys.stderr)
        return 130
    except MemoryError:
        print(f"pi0align {args.command}: error: out of memory (the memory this process may use is too small for "
              "its work)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
