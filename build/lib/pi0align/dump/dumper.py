"""`Dumper`: the public face of the dump part, shaped like msprobe's PrecisionDebugger."""

from __future__ import annotations

import contextlib
import math
import os
import re
from collections.abc import Iterable
from pathlib import Path

import torch

from pi0align.dump.backends.backend import choose_backend
from pi0align.dump.backends.sampling import Sampler
from pi0align.dump.backends.steplog import Filter, StepLog
from pi0align.dump.capturing.capture import Capture
from pi0align.dump.capturing.perturb import UlpPerturbation
from pi0align.dump.file_format import LEVELS, MODES
from pi0align.dump.manifest import build_manifest
from pi0align.dump.ranks import rank_and_world_size
from pi0align.dump.writing import dump_file
from pi0align.dump.writing.dump_file import WRITE_ERRORS
from pi0align.dump.writing.writer import DumpWriter
from pi0align.errors import UserError


class Dumper:
    """Capture every torch API call and module forward/backward of chosen training steps into an
    HDF5 dump file (docs/dump-format.md).

    Either call `start(model, optimizer=optimizer)` once before the loop, `step()` after each
    optimizer step and `stop()` at the end, or, msprobe-style, `start(...)` / `stop()` around each
    step followed by `step()`. Outside the chosen steps nothing is installed on the model. Each
    step records the parameters as the forward reads them, the model's inputs (the batch) as data,
    every call, and, given the optimizer, its update of each parameter (`Optimizer.step`).

    path: a folder (the file is `dump.h5`, `dump-rank<R>.h5` when the world size is above 1) or
        a `.h5` file path.
    steps: the step numbers to dump (counted by `step()` from 0, or from `start(step=...)`);
        None dumps every step.
    level: "api" (torch calls), "module" (module forwards) or "mix" (both).
    mode: "stats" (statistics and checksum), "sample" (plus `sample_size` elements at positions
        fixed by the record's name and shape) or "tensor" (plus every full tensor).
    ranks: the ranks that dump (None: all).
    include, exclude: fnmatch patterns over record names (`module.path/API#k`).
    manifest: run facts to store (seed, seed_impl, config, dataset_fingerprint, git_commit, ...).
    compress: compress the full tensors of tensor mode (shuffle + Zstandard, docs/dump-format.md).
    perturb_ulps: 0, or make this run a noise reference: while the dumper is started, every
        floating result of every torch call (and the gradient flowing back into it) is moved by up
        to this many ulps at random, drawn from a generator seeded with `perturb_seed`
        (`perturb.py`; `pi0align compare A B --noise REF`). Not a training run to keep.
    backend: "native" (the C++ extension: hooks, records and CPU statistics), "torch" (torch ops
        only: the reference, and what accelerators run) or "auto" (native where it builds); stored
        in the file with why (`backend`, `backend_status`).
    """

    def __init__(self, path: str | os.PathLike, steps: Iterable[int] | None = None, level: str = "mix",
                 mode: str = "stats", ranks: Iterable[int] | None = None, include: list[str] | None = None,
                 exclude: list[str] | None = None, sample_size: int = 256, manifest: dict | None = None,
                 compress: bool = True, perturb_ulps: int = 0, perturb_seed: int = 0, backend: str = "auto") -> None:
        if level not in LEVELS:
            raise UserError(f"dump level must be one of {', '.join(LEVELS)}, not {level!r}")
        if mode not in MODES:
            raise UserError(f"dump mode must be one of {', '.join(MODES)}, not {mode!r}")
        if sample_size < 1:
            raise UserError(f"dump sample size must be at least 1, not {sample_size}")
        if perturb_ulps < 0:
            raise UserError(f"perturb_ulps must not be negative, not {perturb_ulps}")
        self.path = Path(path)
        self.steps = None if steps is None else frozenset(int(s) for s in steps)
        self.level, self.mode, self.sample_size = level, mode, sample_size
        self.ranks = None if ranks is None else frozenset(int(r) for r in ranks)
        self._filter = Filter(include, exclude)
        self._manifest = manifest
        self._compress = compress
        self.perturb_ulps = int(perturb_ulps)
        # beneath the capture's own mode, so that the capture records the moved results
        self._perturbation = UlpPerturbation(perturb_ulps, perturb_seed) if perturb_ulps else None
        self._perturbing = False
        self._step = 0
        self._model: torch.nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._created = False  # the dump file exists: a later start() appends to it
        self._writer: DumpWriter | None = None  # between the first start() and close()
        self._tensors_file: str | None = None  # this step's tensor file (tensor mode)
        self._capture: Capture | None = None
        self.backend = choose_backend(backend)
        # Statistics and samples may wait (the native kernel's thread, the torch backend's batches)
        # only where every in-place call is seen (api, mix): a queued tensor must not change
        # before they are taken.
        self._in_place_seen = level != "module"
        self._sampler = (Sampler(sample_size, self.backend.host_gather, self._in_place_seen) if mode == "sample"
                         else None)
        self._metrics: list[tuple] = []
        self._started = False
        self._rank, self._world_size = rank_and_world_size()  # again at start(): after init_process_group

    # ---- public API ----------------------------------------------------------------------------

    @property
    def file(self) -> Path:
        """The dump file of this rank."""
        if self.path.suffix == ".h5":
            return self.path if self._world_size == 1 else self.path.with_stem(f"{self.path.stem}-rank{self._rank}")
        return self.path / ("dump.h5" if self._world_size == 1 else f"dump-rank{self._rank}.h5")

    @property
    def current_step(self) -> int:
        return self._step

    def dumps(self, step: int) -> bool:
        """Whether this dumper records `step`."""
        return self.steps is None or step in self.steps

    @property
    def enabled(self) -> bool:
        """Whether this rank dumps."""
        return self.ranks is None or self._rank in self.ranks

    def start(self, model: torch.nn.Module | None = None, step: int | None = None,
              manifest: dict | None = None, optimizer: torch.optim.Optimizer | None = None) -> Dumper:
        """Begin (or resume, msprobe-style) dumping `model`; `step` sets the current step number,
        `manifest` adds run facts to the manifest, `optimizer` (a torch.optim.Optimizer) has its
        updates recorded. The first call creates the dump file (replacing one left by an earlier
        run)."""
        if manifest is not None:
            self._manifest = {**(self._manifest or {}), **manifest}
        if step is not None:
            self._step = int(step)
        if not self._created:
            self._rank, self._world_size = rank_and_world_size()
        if not self.enabled:
            return self
        self._model = model if model is not None else self._model
        self._optimizer = optimizer if optimizer is not None else self._optimizer
        if self._writer is None:
            self._open_writer()
        self._started = True
        if self._perturbation is not None and not self._perturbing:
            self._perturbation.__enter__()
            self._perturbing = True
        self._follow_selection()
        return self

    def step(self) -> None:
        """End the current training step (write it if it was dumped) and move to the next."""
        self._end_step()
        self._step += 1
        if self._started:
            self._follow_selection()

    def stop(self) -> None:
        """Remove every hook; hand what the current step captured so far, and pending metrics, to
        the writer process."""
        self._started = False
        self._end_step()
        self._uninstall()
        if self._metrics and self._writer is not None:
            with self._write_errors():
                self._write(None)

    def flush(self) -> None:
        """Wait until everything captured so far is in the dump file (and its tensor files)."""
        if self._writer is not None:
            with self._write_errors():
                self._writer.flush()

    def close(self) -> None:
        """`stop()`, then wait until everything is written and end the dumper's threads and writer
        process: the dump is complete. A process that exits without it waits at exit."""
        self.stop()
        if self._writer is not None:
            writer, self._writer = self._writer, None
            with self._write_errors():
                writer.close()

    def record_metrics(self, step: int, loss: float, grad_norm: float | None = None, lr: float | None = None) -> None:
        """Log one training step's loss, gradient norm and learning rate (dumped step or not);
        written with the next dumped step or at `stop()`."""
        if self.enabled:
            self._metrics.append((int(step), *(_as_float(v) for v in (loss, grad_norm, lr))))

    def __enter__(self) -> Dumper:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- internals -----------------------------------------------------------------------------

    def _open_writer(self) -> None:
        """Start the writer process; create the dump file first, the first time."""
        try:
            if not self._created:
                attrs = {
                    "rank": self._rank, "world_size": self._world_size, "mode": self.mode, "level": self.level,
                    "sample_size": self.sample_size if self.mode == "sample" else 0,
                    "backend": self.backend.name, "backend_status": self.backend.status,
                }
                manifest = {**(self._manifest or {}), "perturb_ulps": self.perturb_ulps}
                dump_file.create(self.file, attrs,
                                 build_manifest(self._model, self._rank, self._world_size, manifest))
                self._created = True
            # queued copies only where the capture waits for them before an in-place call
            self._writer = DumpWriter(self.file, tensors=self.mode == "tensor", compress=self._compress,
                                      copier=self.backend.copier if self._in_place_seen else None)
            if self._sampler is not None:
                self._sampler.hand_over_all_positions()  # the new writer process holds none yet
        except WRITE_ERRORS as error:
            raise UserError(f"cannot write the dump file {self.file}: {_reason(error)}") from None

    def _selected(self) -> bool:
        return self.dumps(self._step)

    def _follow_selection(self) -> None:
        """Install the hooks for a chosen step (and open its log), remove them otherwise."""
        if not self._selected():
            self._uninstall()
            return
        if self._capture is None:
            self._capture = Capture(self.level, self._filter, self.backend)
        if not self._capture.installed:
            self._capture.install(self._model, self._optimizer)
        if self._capture.log is None:
            sink = None
            if self.mode == "tensor":
                self._tensors_file = self._writer.begin_step(self._step)
                sink = self._writer.put
            log = StepLog(self._step, self.backend.records(self._in_place_seen, sink, self._sampler), self._sampler)
            self._capture.begin_step(log)

    def _uninstall(self) -> None:
        """Remove the capture's hooks, then the perturbation beneath them."""
        if self._capture is not None and self._capture.installed:
            self._capture.remove()
        if self._perturbing and not self._started:
            self._perturbation.__exit__(None, None, None)
            self._perturbing = False

    def _end_step(self) -> None:
        """Hand the current step to the writer process (its tables if it captured anything)."""
        if self._capture is None or self._capture.log is None:
            return
        log = self._capture.end_step()
        with self._write_errors():
            self._write(log)

    @contextlib.contextmanager
    def _write_errors(self):
        """A write that fails (full disk, vanished folder) removes every hook, then says so in one line."""
        try:
            yield
        except WRITE_ERRORS as error:
            self._started = False
            self._uninstall()
            raise UserError(f"cannot write the dump file {self.file}: {_reason(error)}") from None

    def _write(self, log: StepLog | None) -> None:
        with torch._C.DisableTorchFunction():
            captured = log.finish() if log is not None else None
        stacks = self._capture.stacks.take_new() if self._capture is not None else []
        metrics, self._metrics = self._metrics, []
        tensors_file, self._tensors_file = self._tensors_file, None
        self._writer.end_step(captured, stacks, metrics, tensors_file if captured is not None else None)


def _as_float(value) -> float:
    if value is None:
        return math.nan
    return float(value.item() if isinstance(value, torch.Tensor) else value)


def _reason(error: Exception) -> str:
    """The operating system's words for it (h5py buries them in a longer message)."""
    text = getattr(error, "strerror", None) or str(error)
    found = re.search(r"error message = '([^']*)'", text)
    lines = text.splitlines()
    return found.group(1) if found else lines[0] if lines else type(error).__name__
