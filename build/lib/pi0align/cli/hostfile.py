"""`pi0align hostfile`: a DeepSpeed hostfile for training across nodes, from the environment the
platform sets, and the commands that launch `pi0align run` there (DeepSpeed and torchrun).

    NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 pi0align hostfile --slots 8 --node-list nodes.txt \\
        -- --preset full --steps 20000

Exit code: 0 written, 2 bad environment (one line).
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--slots", metavar="N",
                        help="processes (devices) per node (default: the environment's NPROC_PER_NODE)")
    parser.add_argument("--node-list", type=Path, metavar="FILE",
                        help="the nodes' addresses, one per line, the master first (needed for the hostfile, "
                             "and with the platform's VC_WORKER_NUM / VC_TASK_INDEX)")
    parser.add_argument("--out", type=Path, default=Path("hostfile"), metavar="PATH",
                        help="where to write the hostfile (default: %(default)s)")
    parser.add_argument("run_args", nargs=argparse.REMAINDER, metavar="-- RUN_ARGS",
                        help="the `pi0align run` flags the launch commands carry")


def main(args: argparse.Namespace) -> int:
    import os

    from pi0align.report.output import output_path
    from pi0align.train.hostfile import cluster_from_environment, hostfile_text, launch_commands

    cluster = cluster_from_environment(os.environ, slots=args.slots, node_list=args.node_list)
    written = None
    if cluster.nodes:
        with output_path(args.out) as path:
            path.write_text(hostfile_text(cluster))
        written = args.out
        print(f"wrote {written}: {cluster.nnodes} node(s) × {cluster.slots} slot(s)")
    else:
        print("no hostfile (give --node-list FILE for one): torchrun needs only the master's address")
    run_args = [a for a in args.run_args if a != "--"]
    for launcher, command in launch_commands(cluster, written, run_args).items():
        print(f"{launcher}: {command}")
    if not any(a == "--out" or a.startswith("--out=") for a in run_args):
        print("note: add --out DIR to the run's flags: every process of the run writes to one folder")
    return 0
