"""The one config object of a training run. Every field is a `pi0align run` flag of the same name,
made from the field (its type, default, choices and `flag` metadata) by cli/run.py; the config
checks itself when made, so a bad value fails the same way from the command line, a resumed run's
saved config, or Python."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from pi0align.errors import UserError

# the case study's two single-node scripts (Ascend's Pi-0 test/train_8p_performance.sh and
# train_8p.sh): 12 samples per card on 8 cards, a global batch of 96; the flags given win
RECIPES = {"perf": {"steps": 1000, "batch_size": 12, "nproc": 8},
           "accuracy": {"steps": 20000, "batch_size": 12, "nproc": 8}}
CHOICES = {"preset": ("full", "small", "tiny"), "dtype": ("fp32", "bf16"), "seed_impl": ("msprobe", "pi0align"),
           "optimizer": ("adamw", "adamw-fused"), "recipe": (None, *RECIPES), "engine": ("torch", "deepspeed"),
           "zero_stage": (0, 1, 2, 3)}
AT_LEAST_ONE = ("steps", "batch_size", "threads", "nproc", "monitor_depth")
NOT_NEGATIVE = ("num_workers", "save_every", "log_every")


def flag(help: str, group: str = "run", metavar: str | None = None, negation: str | None = None) -> dict:
    """A field's `pi0align run` flag (cli/run.py makes them from these): its help, its section of
    `--help`, and, for a bool that is on by default, the flag that turns it off (a bool off by
    default is turned on by its own flag)."""
    return {"help": help, "group": group, "metavar": metavar, "negation": negation}


def local_world_size() -> str:
    """The processes on this node, as a launcher says it: torchrun's LOCAL_WORLD_SIZE, DeepSpeed's
    LOCAL_SIZE (as text; 1 without a launcher)."""
    return os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or "1"


def _threads() -> int:
    """The node's cores, shared among its processes (as many as a launcher says)."""
    try:
        processes = int(local_world_size())
    except ValueError:
        processes = 1  # distributed.launched says what is wrong with it, in one line
    return max(1, (os.cpu_count() or 1) // max(1, processes))


@dataclass
class TrainConfig:
    device: str = field(default="cpu", metadata=flag("cpu, cuda[:N] or npu[:N]"))
    seed: int = field(default=1234, metadata=flag("seed for every random source"))
    preset: str = field(default="small", metadata=flag("model size; small presets keep PI0's architecture"))
    dtype: str = field(default="fp32", metadata=flag("parameters' dtype"))
    steps: int = field(default=50, metadata=flag("optimizer steps"))
    batch_size: int = field(default=8, metadata=flag("samples per step and process (the global batch: × processes)"))
    # None: the PI0 optimizer preset's peak learning rate
    lr: float | None = field(default=None, metadata=flag("peak learning rate (default: PI0's preset, 2.5e-5)"))
    adam_eps: float | None = field(default=None, metadata=flag("AdamW's epsilon (default: PI0's preset, 1e-8)",
                                                               metavar="X"))
    num_workers: int = field(default=0, metadata=flag("dataloader workers"))
    threads: int = field(default_factory=_threads, metadata=flag("torch CPU threads of each process"))
    nproc: int = field(default=1, metadata=flag(
        "processes on this node, launched by torch.distributed.run (DDP; gloo on the CPU, NCCL, HCCL)", "scale"))
    engine: str = field(default="torch", metadata=flag(
        "torch: the policy in DDP (bare in one process); deepspeed: DeepSpeed's engine, where installed", "scale"))
    zero_stage: int = field(default=0, metadata=flag("DeepSpeed's ZeRO stage (--engine deepspeed)", "scale"))
    optimizer: str = field(default="adamw", metadata=flag(
        "adamw: PI0's AdamW; adamw-fused: torch's fused AdamW (torch_npu's NpuFusedAdamW on the NPU)", "scale"))
    bind_cores: bool = field(default=False, metadata=flag(
        "bind each process to its share of the node's cores (coarse-grained)", "scale"))
    profile: str | None = field(default=None, metadata=flag(
        "record steps START to END-1 with torch.profiler into <out>/profile/", "scale", "START:END"))
    recipe: str | None = field(default=None, metadata=flag(
        "the case study's 8-card scripts: perf (1,000 steps) or accuracy (20,000), 12 samples per process on 8, "
        "their log and summary files; flags given win", "scale"))
    log_every: int = field(default=1, metadata=flag("console line every N steps; 0: none"))
    save_every: int = field(default=0, metadata=flag("checkpoint every N steps; 0: only at the end"))
    out: Path | None = field(default=None, metadata=flag("run folder (default: dumps/<device>-seed<seed>-<time>/)"))
    dataset: Path | None = field(default=None, metadata=flag(
        "local LeRobot dataset (default: built-in synthetic koch-like dataset)", "inputs", "ROOT"))
    tokenizer: Path | None = field(default=None, metadata=flag(
        "PaliGemma tokenizer folder (required by --preset full)", "inputs", "DIR"))
    pretrained: Path | None = field(default=None, metadata=flag(
        "LeRobot policy folder with model.safetensors (e.g. lerobot/pi0)", "inputs", "DIR"))
    seed_impl: str = field(default="msprobe", metadata=flag(
        "msprobe: msprobe's seed_all when installed, else ours; pi0align: always ours", "seeding"))
    deterministic: bool = field(default=True, metadata=flag(
        "allow non-deterministic algorithms", "seeding", negation="--no-deterministic"))  # seed_all(mode=...)
    rm_dropout: bool = field(default=True, metadata=flag(
        "leave dropout active", "seeding", negation="--keep-dropout"))  # seed_all(rm_dropout=...)
    progress: bool = field(default=True, metadata=flag("no progress bar", negation="--no-progress"))
    monitor: bool = field(default=True, metadata=flag(
        "no monitor (every module's norms at every step into <out>/monitor.h5)", negation="--no-monitor"))
    # None: the blocks a person thinks in (dump/monitoring/monitor.py, monitored_modules)
    monitor_depth: int | None = field(default=None, metadata=flag(
        "monitor the modules whose path has N parts (default: every layer, projection and head)", metavar="N"))
    dump_on_alert: bool = field(default=False, metadata=flag(
        "dump the step after a monitor alert (stats), into <out>/alerts/<step>/"))

    def __post_init__(self) -> None:
        for name, choices in CHOICES.items():
            if getattr(self, name) not in choices:
                raise UserError(f"--{flag_name(name)} must be one of {', '.join(choices)}, not {getattr(self, name)!r}")
        for name in AT_LEAST_ONE:
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise UserError(f"--{flag_name(name)} must be at least 1")
        for name in NOT_NEGATIVE:
            if getattr(self, name) < 0:
                raise UserError(f"--{flag_name(name)} must not be negative")
        self.profile_steps  # noqa: B018 (checks the window)

    @property
    def profile_steps(self) -> range:
        """The steps `profile` (START:END, END not included; START alone: one step) records."""
        if not self.profile:
            return range(0)
        start, sep, end = str(self.profile).partition(":")
        try:
            steps = range(int(start), int(end)) if sep else range(int(start), int(start) + 1)
        except ValueError:
            raise UserError(f"--profile takes START:END (steps, END not included), not {self.profile!r}") from None
        if steps.start < 0 or not len(steps):
            raise UserError(f"--profile {self.profile}: START must be at least 0 and END above it")
        return steps

    def to_json(self) -> dict:
        fields = dataclasses.asdict(self)
        return {key: str(value) if isinstance(value, Path) else value for key, value in fields.items()}

    @classmethod
    def from_json(cls, data: dict) -> TrainConfig:
        paths = {f.name for f in dataclasses.fields(cls) if "Path" in str(f.type)}
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: (Path(v) if k in paths and v is not None else v) for k, v in data.items() if k in known})

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")


def flag_name(field_name: str) -> str:
    return field_name.replace("_", "-")
