"""What `pi0align attach` asks of each process it loads into, passed through the environment."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

from pi0align.errors import UserError

ENVIRONMENT = "PI0ALIGN_ATTACH"  # the settings, as JSON, for every process the command starts


@dataclass(frozen=True)
class AttachSettings:
    """One attach: where its files go and what it does in each process."""

    out: str
    """The folder of the dumps, monitors, manifest and per-step log (absolute)."""
    command: tuple[str, ...] = ()
    """The command attached to, as given (recorded in the manifest)."""
    seed: int | None = None
    """`seed_all(seed)` before the script's own code runs; None: the script's own seeding only."""
    rm_dropout: bool = False
    """With `seed`: every dropout made an identity (seed_all's rm_dropout)."""
    threads: int | None = None
    """torch's CPU threads, set before the script runs; None: the script's (or torch's) choice."""
    dump_steps: tuple[int, ...] | None = None
    """The optimizer steps to dump (counted from 0); None: no dump."""
    dump_level: str = "mix"
    """The Dumper's level: api, module or mix."""
    dump_mode: str = "stats"
    """The Dumper's mode: stats, sample or tensor."""
    dump_backend: str = "auto"
    """The Dumper's backend: auto, native or torch."""
    monitor: bool = True
    """The Monitor at every step (monitor.h5)."""
    monitor_depth: int | None = None
    """The Monitor's module depth; None: the blocks a person thinks in."""
    model_attr: str | None = None
    """The module to watch, as a dotted attribute path from the module the first optimizer trains
    (`model`: LeRobot policy's network) or from the script's globals; None: that module itself."""

    def to_environment(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_environment(cls) -> AttachSettings | None:
        text = os.environ.get(ENVIRONMENT)
        if not text:
            return None
        try:
            values = json.loads(text)
            values["command"] = tuple(values.get("command") or ())
            if values.get("dump_steps") is not None:
                values["dump_steps"] = tuple(values["dump_steps"])
            return cls(**values)
        except (ValueError, TypeError) as error:
            raise UserError(f"{ENVIRONMENT} is not pi0align attach's settings ({error})") from None
