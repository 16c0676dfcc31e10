"""`pi0align curves --tensorboard DIR`: the runs' logs and monitors as TensorBoard scalars, a
folder per run (torch.utils.tensorboard's writer), for people who live there."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from pi0align.errors import UserError

LOGGED = ("loss", "grad_norm", "lr", "samples_per_s")


def write_tensorboard(frame: pd.DataFrame, monitor: pd.DataFrame | None, folder: str | Path) -> Path:
    """`train/<metric>` from each run's log, `<module>/<quantity>` from its monitor (finite values)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as error:
        raise UserError(f"--tensorboard needs torch and tensorboard ({error})") from None
    folder = Path(folder)
    for run, own in frame.groupby("run", sort=False):
        try:
            writer = SummaryWriter(log_dir=str(folder / run.replace("/", "_")))
        except OSError as error:
            raise UserError(f"cannot write {folder}: {error.strerror or error}") from None
        with writer:
            for record in own.itertuples(index=False):
                for metric in LOGGED:
                    value = getattr(record, metric)
                    if pd.notna(value):
                        writer.add_scalar(f"train/{metric}", float(value), int(record.step))
            if monitor is not None:
                mine = monitor[(monitor["run"] == run) & monitor["value"].notna()]
                for row in mine.itertuples(index=False):
                    writer.add_scalar(f"{row.module}/{row.quantity}", float(row.value), int(row.step))
    return folder
