"""The one config object of a training run. Every field is a `pi0align run` flag of the same name;
the config checks itself when made, so a bad value fails the same way from the command line, a
resumed run's saved config, or Python."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from pi0align.errors import UserError

CHOICES = {"preset": ("full", "small", "tiny"), "dtype": ("fp32", "bf16"), "seed_impl": ("msprobe", "pi0align")}
AT_LEAST_ONE = ("steps", "batch_size", "threads")
NOT_NEGATIVE = ("num_workers", "save_every", "log_every")


@dataclass
class TrainConfig:
    device: str = "cpu"
    seed: int = 1234
    preset: str = "small"  # full | small | tiny
    dtype: str = "fp32"  # fp32 | bf16
    steps: int = 50
    batch_size: int = 8
    lr: float | None = None  # None: the PI0 optimizer preset's peak learning rate
    num_workers: int = 0
    threads: int = field(default_factory=lambda: os.cpu_count() or 1)  # torch intra-op threads
    log_every: int = 1
    save_every: int = 0  # 0: only the final checkpoint
    out: Path | None = None  # None: dumps/<device>-seed<seed>-<time>/
    dataset: Path | None = None  # None: the built-in synthetic koch-like dataset
    tokenizer: Path | None = None  # None: a small generated tokenizer (small presets only)
    pretrained: Path | None = None  # None: random init from the seed
    seed_impl: str = "msprobe"  # preferred seed_all: msprobe's when installed, else ours; "pi0align": always ours
    deterministic: bool = True  # seed_all(mode=...)
    rm_dropout: bool = True  # seed_all(rm_dropout=...)
    progress: bool = True  # rich progress bar

    def __post_init__(self) -> None:
        for name, choices in CHOICES.items():
            if getattr(self, name) not in choices:
                raise UserError(f"--{_flag(name)} must be one of {', '.join(choices)}, not {getattr(self, name)!r}")
        for name in AT_LEAST_ONE:
            if getattr(self, name) < 1:
                raise UserError(f"--{_flag(name)} must be at least 1")
        for name in NOT_NEGATIVE:
            if getattr(self, name) < 0:
                raise UserError(f"--{_flag(name)} must not be negative")

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


def _flag(field_name: str) -> str:
    return field_name.replace("_", "-")
