"""Per-step metrics: the JSON-lines log, the live progress display, and the end-of-run summary."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


class MetricsLog:
    """`train_log.jsonl`: one JSON object per step, flushed as written. On resume, steps from
    `keep_before` on are dropped first, so the file reads as one uninterrupted run."""

    def __init__(self, path: Path, keep_before: int = 0):
        self.path = path
        self.records: list[dict] = []
        if keep_before and path.is_file():
            kept = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            self.records = [record for record in kept if record["step"] < keep_before]
        path.write_text("".join(json.dumps(record) + "\n" for record in self.records))

    def write(self, **record) -> dict:
        self.records.append(record)
        with self.path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")
        return record


class ProgressDisplay:
    """A rich progress bar with step, loss and images/sec; `log_line` also prints the step's line."""

    def __init__(self, total_steps: int, start_step: int, enabled: bool = True):
        self.console = Console(stderr=True, log_path=False)
        self.progress = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[rate]} img/s"),
            TimeRemainingColumn(), console=self.console, disable=not enabled,
        )
        self.task = self.progress.add_task("train", total=total_steps, completed=start_step, loss="-", rate="-")

    def __enter__(self):
        self.progress.start()
        return self

    def __exit__(self, *exc):
        self.progress.stop()

    def update(self, record: dict, log_line: bool) -> None:
        self.progress.update(self.task, advance=1, loss=f"{record['loss']:.4f}", rate=f"{record['samples_per_s']:.1f}")
        if log_line:
            self.progress.console.log(step_line(record))


def step_line(record: dict) -> str:
    return (f"step {record['step']} loss {record['loss']:.6f} grad_norm {record['grad_norm']:.4f} "
            f"lr {record['lr']:.2e} {record['step_time_s'] * 1000:.0f}ms {record['samples_per_s']:.1f}img/s")


class RecipeLogs:
    """What the case study's scripts leave for their tooling (`run --recipe`), in the run folder:
    `train_<recipe>_<N>p_base_<dtype>.log`, every step's line as it ends, and
    `Pi0_bs<batch>_<N>p_<acc|perf>.log`, the three summary lines (N processes, batch per process)."""

    def __init__(self, out: Path, recipe: str, processes: int, batch_size: int, dtype: str, resumed: bool):
        self.steps = out / f"train_{recipe}_{processes}p_base_{dtype}.log"
        self.summary = out / f"Pi0_bs{batch_size}_{processes}p_{'acc' if recipe == 'accuracy' else 'perf'}.log"
        if not resumed:
            self.steps.write_text("")

    def write(self, record: dict) -> None:
        with self.steps.open("a") as handle:
            handle.write(step_line(record) + "\n")

    def finish(self, summary: dict) -> None:
        self.summary.write_text("".join(line + "\n" for line in summary_lines(summary)))


def warmup_steps(step_count: int) -> int:
    """Steps left out of the throughput: the first 10% (at least one when there are two or more)."""
    return 0 if step_count < 2 else max(1, step_count // 10)


def summarize(records: list[dict], *, batch_size: int, e2e_seconds: float) -> dict:
    """images/sec = samples per second of the global batch over the steps after warm-up
    (one sample = one observation with all its camera images, as Ascend's PI0 scripts count)."""
    timed = records[warmup_steps(len(records)):]
    mean_step = statistics.fmean(r["step_time_s"] for r in timed) if timed else math.nan
    return {
        "steps": len(records),
        "final_loss": records[-1]["loss"] if records else math.nan,
        "final_grad_norm": records[-1]["grad_norm"] if records else math.nan,
        "images_per_sec": batch_size / mean_step if timed else math.nan,
        "mean_step_time_s": mean_step,
        "timed_steps": len(timed),
        "e2e_seconds": e2e_seconds,
    }


def summary_lines(summary: dict) -> list[str]:
    """The three lines Ascend's PI0 training scripts print, which their tooling greps."""
    return [
        f"Final Performance images/sec: {summary['images_per_sec']:.2f}",
        f"Final Train Loss: {summary['final_loss']:.6f}",
        f"E2E Training Duration sec: {summary['e2e_seconds']:.2f}",
    ]
