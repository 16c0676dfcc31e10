"""TensorBoard event files, read with tensorboard's own reader; steps taken as written."""

from __future__ import annotations

from pathlib import Path

from pi0align.errors import UserError
from pi0align.runs.logs.records import Log, LogOptions, head

LOSS_TAGS = ("train/loss", "loss", "train_loss", "Loss", "train/train_loss", "losses/train")


def is_event_file(path: Path) -> bool:
    """A TensorBoard event file: TFRecords whose first event names the event format."""
    return b"brain.Event:" in head(path)[:128]


def read_tensorboard(files: list[Path], options: LogOptions) -> Log:
    """Scalars of TensorBoard event files (tensorboard's own reader): the loss's tag, and the
    gradient norm's and learning rate's where present."""
    try:
        from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
        from tensorboard.util import tensor_util
    except ImportError:
        raise UserError("reading TensorBoard event files needs tensorboard: pip install 'pi0align[tensorboard]'") \
            from None
    scalars: dict[str, dict[int, float]] = {}
    for file in files:
        try:
            for event in EventFileLoader(str(file)).Load():
                for value in event.summary.value:
                    number = value.simple_value if value.HasField("simple_value") else \
                        float(tensor_util.make_ndarray(value.tensor).reshape(-1)[0]) if value.HasField("tensor") \
                        else None
                    if number is not None:
                        scalars.setdefault(value.tag, {})[int(event.step)] = float(number)
        except Exception as error:  # tensorboard's reader raises its own kinds for damaged records
            raise UserError(f"{file}: not a readable TensorBoard event file ({type(error).__name__}: {error})") \
                from None
    tags = (options.loss_tag,) if options.loss_tag else LOSS_TAGS
    loss_tag = next((tag for tag in tags if tag in scalars), None)
    if loss_tag is None:
        raise UserError(f"{files[0].parent}: no scalar tagged {' or '.join(tags)} (its tags: "
                        f"{', '.join(sorted(scalars)[:12]) or 'none'}; choose one with --loss-tag)")
    prefix = loss_tag.rpartition("/")[0]
    extra = {name: scalars.get(f"{prefix}/{name}" if prefix else name, {}) for name in ("grad_norm", "lr")}
    records = [{"step": step, "loss": loss, **{name: values[step] for name, values in extra.items() if step in values}}
               for step, loss in sorted(scalars[loss_tag].items())]
    return Log(kind=f"TensorBoard ({loss_tag})", records=records, summary={}, manifest={})
