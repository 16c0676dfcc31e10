"""Training across nodes: the cluster from the environment a platform sets, a DeepSpeed hostfile
(`ip slots=N` per node) and the launch commands for DeepSpeed and torchrun (`pi0align hostfile`).
Pure functions of the environment given; every bad one is one UserError line.

Two kinds of environment: the generic one (NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT), and a
platform's (VC_WORKER_NUM, VC_TASK_INDEX) with a node list file, one address per line, the first
the master's. A hostfile lists every node, so it needs the node list; torchrun needs only the
master.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from pi0align.errors import UserError

DEFAULT_PORT = 29500


@dataclass(frozen=True)
class Cluster:
    """The nodes (their addresses, the master first; empty where no node list was given), this
    node's rank, the processes per node (slots), and the master's address and port."""

    nnodes: int
    node_rank: int
    slots: int
    master_addr: str
    master_port: int
    nodes: tuple[str, ...] = ()


def cluster_from_environment(env: Mapping[str, str], slots: int | str | None = None,
                             node_list: Path | None = None) -> Cluster:
    """The cluster `env` describes. `slots`: processes per node (default: NPROC_PER_NODE)."""
    slots = _whole(slots if slots is not None else env.get("NPROC_PER_NODE"), "slots (processes per node)",
                   "--slots N or NPROC_PER_NODE")
    nodes = _node_list(node_list) if node_list is not None else ()
    if "VC_WORKER_NUM" in env:
        nnodes = _whole(env["VC_WORKER_NUM"], "VC_WORKER_NUM", "the platform's worker count")
        node_rank = _whole(env.get("VC_TASK_INDEX"), "VC_TASK_INDEX", "the platform's index of this worker", zero=True)
        if node_list is None:
            raise UserError("VC_WORKER_NUM is set: the node list file is needed too (--node-list FILE), "
                            "its first address the master's")
        master = nodes[0] if nodes else ""
    elif "NNODES" in env:
        nnodes = _whole(env["NNODES"], "NNODES", "the node count")
        node_rank = _whole(env.get("NODE_RANK", "0"), "NODE_RANK", "this node's rank", zero=True)
        master = env.get("MASTER_ADDR", "")
        if not master:
            raise UserError("MASTER_ADDR is not set: the master node's address (NNODES is set)")
    else:
        raise UserError("no cluster in the environment: set NNODES, NODE_RANK, MASTER_ADDR (and MASTER_PORT), or "
                        "the platform's VC_WORKER_NUM and VC_TASK_INDEX with --node-list FILE")
    if node_rank >= nnodes:
        raise UserError(f"this node's rank {node_rank} is not below the node count {nnodes}")
    if node_list is not None and len(nodes) < nnodes:
        raise UserError(f"{node_list} lists {len(nodes)} node(s), fewer than the {nnodes} workers")
    port = _whole(env.get("MASTER_PORT", str(DEFAULT_PORT)), "MASTER_PORT", "the master's port")
    return Cluster(nnodes=nnodes, node_rank=node_rank, slots=slots, master_addr=master, master_port=port,
                   nodes=tuple(nodes[:nnodes]))


def _whole(value, name: str, what: str, zero: bool = False) -> int:
    if value is None or str(value).strip() == "":
        raise UserError(f"{name} is not set: {what}")
    try:
        number = int(str(value).strip())
    except ValueError:
        raise UserError(f"{name} must be a whole number ({what}), not {value!r}") from None
    if number < (0 if zero else 1):
        raise UserError(f"{name} must be at least {0 if zero else 1}, not {number}")
    return number


def _node_list(path: Path) -> tuple[str, ...]:
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise UserError(f"{path}: cannot read the node list ({error})") from None
    nodes = tuple(line.split()[0] for line in lines if line.strip() and not line.lstrip().startswith("#"))
    if not nodes:
        raise UserError(f"{path}: the node list holds no address")
    return nodes


def hostfile_text(cluster: Cluster) -> str:
    """DeepSpeed's hostfile: `ip slots=N` per node."""
    if not cluster.nodes:
        raise UserError("a hostfile lists every node: give the node list (--node-list FILE)")
    return "".join(f"{node} slots={cluster.slots}\n" for node in cluster.nodes)


def launch_commands(cluster: Cluster, hostfile: Path | None, run_args: Sequence[str]) -> dict[str, str]:
    """The commands that start `pi0align run RUN_ARGS` on the cluster: DeepSpeed's launcher (on the
    master, with the hostfile) and torchrun (on every node)."""
    run = ["-m", "pi0align.cli.main", "run", *run_args]
    commands = {"torchrun": shlex.join(["torchrun", "--nnodes", str(cluster.nnodes), "--node_rank",
                                        str(cluster.node_rank), "--nproc_per_node", str(cluster.slots),
                                        "--master_addr", cluster.master_addr, "--master_port",
                                        str(cluster.master_port), *run])}
    if hostfile is not None:
        # --no_local_rank: the rank is in the environment, not an argument `pi0align run` would refuse
        commands["deepspeed"] = shlex.join(["deepspeed", "--hostfile", str(hostfile), "--master_addr",
                                            cluster.master_addr, "--master_port", str(cluster.master_port),
                                            "--no_local_rank", "--module", "pi0align.cli.main", "run", *run_args])
    return commands
