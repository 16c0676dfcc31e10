"""The two runs a bisect reads: the reference (A: a run folder with checkpoints, its log and
config) and the run under test (B: its log at least, and its manifest where it has one), checked
to be runs of one configuration, with where B's loss leaves A's band and, where both have a
monitor, the module and quantity that leave theirs first (runs/monitor.py): often thousands of
steps before the loss."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pi0align.errors import UserError
from pi0align.runs.curves import relative_error
from pi0align.runs.envdiff import env_diff
from pi0align.runs.folder import read_run
from pi0align.runs.monitor import Leaving

# env-diff's items of where and how a run computes, which B's device may change: everything else
# that matters (seed, data, model, hyper-parameters, batch, steps, dtype, world size) must match,
# or a probe from A's state answers nothing about B
WHERE_IT_RUNS = frozenset({
    "torch", "torch_npu", "cann", "transformers", "lerobot", "deepspeed", "accelerate", "device", "device name",
    "CPU architecture", "CPU model", "CPU code path", "BLAS", "oneDNN", "threads", "autocast on cpu",
    "autocast on cuda", "autocast on npu", "float32_matmul_precision", "cuda_matmul_allow_tf32", "cudnn_allow_tf32",
    "cudnn_deterministic", "deterministic_algorithms", "npu_matmul_allow_hf32", "npu_conv_allow_hf32",
    "CUBLAS_WORKSPACE_CONFIG", "HCCL_DETERMINISTIC", "NVIDIA_TF32_OVERRIDE", "OMP_NUM_THREADS", "optimizer",
    "engine", "ZeRO stage", "transformers compatibility", "initial weights"})


@dataclass(frozen=True)
class Runs:
    """The reference's folder, its per-step log ({step: record}) and its checkpoints (the steps
    after which one was saved); the run under test's log; where B runs (device, threads) as its
    manifest says; the first step whose loss leaves A's band (None: never); the first module
    quantity of B's monitor to leave A's band (None: never, or no monitors: `monitors` says)."""

    reference: Path
    logged: dict[int, dict]
    checkpoints: list[int]
    under_test: Path
    logged_b: dict[int, dict]
    device: str | None
    threads: int | None
    parts_at: int | None
    first_module: Leaving | None = None
    monitors: str = ""  # what the monitors said, or why they were not compared

    @property
    def parts_first_at(self) -> int | None:
        """The first step where B parts from A, by its loss or by a module."""
        steps = [s for s in (self.parts_at, self.first_module and self.first_module.first_outside) if s is not None]
        return min(steps, default=None)


def read_runs(a: str | Path, b: str | Path, tolerance: float, device: str | None = None) -> Runs:
    """A and B as a bisect needs them; one UserError line where they cannot be bisected: A without
    checkpoints, B without a log, runs of other configurations."""
    run_a, run_b = read_run(a, need_log=True), read_run(b, need_log=True)
    logged = {r["step"]: r for r in run_a.log}
    # a checkpoint after K steps starts step K, which A must have logged (its last one starts none)
    checkpoints = sorted(int(folder.name) for folder in (run_a.path / "checkpoints").glob("[0-9]" * 6)
                         if (folder / "training_state.pt").is_file() and int(folder.name) in logged)
    if not checkpoints:
        raise UserError(f"{run_a.path}: no checkpoints to start probes from: run it with --save-every N")
    if run_a.manifest and run_b.manifest:
        other = [line for line in env_diff(run_a.manifest, run_b.manifest).matters if line.item not in WHERE_IT_RUNS]
        if other:
            listed = ", ".join(f"{line.item} ({line.a} in A, {line.b} in B)" for line in other[:3])
            raise UserError(f"{run_a.path} and {run_b.path} are runs of other configurations ({listed}): bisect "
                            "probes B's device from A's state, so B must train A's configuration (pi0align env-diff)")
    config = run_b.manifest.get("config") or {}
    first_module, monitors = _first_module(run_a.path, run_b.path)
    return Runs(reference=run_a.path, logged=logged, checkpoints=checkpoints,
                under_test=run_b.path, logged_b={r["step"]: r for r in run_b.log},
                device=device or run_b.manifest.get("device") or config.get("device"),
                threads=config.get("threads"), parts_at=_parts_at(run_a.log, run_b.log, tolerance),
                first_module=first_module, monitors=monitors)


def _first_module(a: Path, b: Path) -> tuple[Leaving | None, str]:
    """B's first module quantity outside A's band (the default band), and what the monitors said."""
    from pi0align.runs.monitor import compare_modules, load_monitor

    try:
        comparison = compare_modules(load_monitor([a, b]))
    except UserError as error:
        return None, f"monitors not compared: {error}"
    (first,) = comparison.first_outside.values()
    if first is None:
        return None, f"every module of B's monitor stays within ±{comparison.band:g} of A's"
    return first, (f"B's monitor: {first.module} {first.quantity} leaves ±{comparison.band:g} of A's first, at step "
                   f"{first.first_outside}")


def _parts_at(log_a: list[dict], log_b: list[dict], tolerance: float) -> int | None:
    """The first step whose relative loss error leaves `tolerance` (curves' rule), None if none."""
    import pandas as pd

    loss = lambda log: pd.Series({r["step"]: float(r["loss"]) for r in log}).sort_index()  # noqa: E731
    error = relative_error(loss(log_a), loss(log_b))
    outside = error.index[error > tolerance]
    return int(outside[0]) if len(outside) else None
