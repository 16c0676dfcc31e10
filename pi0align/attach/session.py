"""The attach in one process: seeded before the script runs; the model found through the first
optimizer the script builds; the step counted by that optimizer's steps (torch's global optimizer
hooks); the Dumper started at the model's forward of each dumped step and stopped after the
optimizer's step; the Monitor at every step, its gradients' norms those of the script's clip
(pi0align/clipping.py: torch's, bit for bit), taken before the gradients are scaled; the loss taken
from the model's output; the manifest and a per-step log written by rank 0. Nothing here changes a
number the script computes."""

from __future__ import annotations

import atexit
import functools
import gc
import json
import math
import sys
import time
from datetime import datetime
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from pi0align.attach.settings import AttachSettings
from pi0align.clipping import clip_gradients
from pi0align.device import Device
from pi0align.dump.ranks import rank_and_world_size
from pi0align.errors import UserError
from pi0align.provenance import environment, weights_sha256

MANIFEST, LOG = "manifest.json", "train_log.jsonl"


def _one_line(handler):
    """An event handler whose bad input (a UserError) ends the process in one line, exit 2."""
    @functools.wraps(handler)
    def handle(*args, **kwargs):
        try:
            return handler(*args, **kwargs)
        except UserError as error:
            print(f"pi0align attach: {error}", file=sys.stderr)
            raise SystemExit(2) from None

    return handle


class Session:
    """One process's attach (install() once, at start-up; close() at exit)."""

    def __init__(self, settings: AttachSettings) -> None:
        self.settings, self.out = settings, Path(settings.out)
        self.optimizer: torch.optim.Optimizer | None = None
        self.model: torch.nn.Module | None = None
        self.step = 0  # the optimizer's steps so far
        self.seed_impl: str | None = None
        self._dumper = self._monitor = None
        self._dumping = self._inside = False
        self._manifest: dict | None = None
        self._losses: list[torch.Tensor] = []
        self._grad_norm = self._lr = None
        self._gradients_read = False  # by the monitor, this step (a script may clip several groups)
        self._step_started: float | None = None

    def install(self) -> None:
        if self.settings.threads:
            torch.set_num_threads(self.settings.threads)
        if self.settings.seed is not None:
            from pi0align.seed import seed_all

            self.seed_impl = seed_all(self.settings.seed, mode=True, rm_dropout=self.settings.rm_dropout)
        _wrap(torch.optim.Optimizer, "__init__", self._optimizer_built)
        clip = torch.nn.utils.clip_grad_norm_
        for owner in (torch.nn.utils, torch.nn.utils.clip_grad):  # both names scripts import it by
            _wrap(owner, "clip_grad_norm_", self._clipping, original=clip)
        register_optimizer_step_pre_hook(self._before_step)
        register_optimizer_step_post_hook(self._after_step)
        atexit.register(self.close)

    # ---- the script's events --------------------------------------------------------------------

    @_one_line
    def _optimizer_built(self, optimizer: torch.optim.Optimizer) -> None:
        if self.optimizer is not None:
            return
        self.optimizer = optimizer
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        found = _module_holding(held)
        if found is None:
            raise UserError(f"the first optimizer ({type(optimizer).__name__}) trains parameters no torch module "
                            "holds: nothing to attach to")
        self.model = self._named(found) if self.settings.model_attr else found
        self._wrap_forward(self.model)
        if self.settings.monitor:
            from pi0align.dump.monitoring.alerts import AlertRules
            from pi0align.dump.monitoring.monitor import Monitor

            self._monitor = Monitor(self.out, depth=self.settings.monitor_depth, alerts=AlertRules())
            self._monitor.start(self.model, optimizer)
        if self.settings.dump_steps is not None:
            from pi0align.dump import Dumper

            self._dumper = Dumper(self.out, steps=self.settings.dump_steps, level=self.settings.dump_level,
                                  mode=self.settings.dump_mode, backend=self.settings.dump_backend)

    @_one_line
    def _before_forward(self) -> None:
        if self._manifest is None:
            self._manifest = self._build_manifest()
        if self._step_started is None:
            self._step_started = time.perf_counter()
        if self._dumper is not None and not self._dumping and self._dumper.dumps(self.step):
            self._dumper.start(self.model, step=self.step, manifest=self._manifest, optimizer=self.optimizer)
            self._dumping = True

    def _clipping(self, original, parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        # the monitor reads the gradients as the backward left them, at the step's first clip
        reading = self._monitor is not None and not self._gradients_read
        if reading and float(norm_type) == 2.0 and not error_if_nonfinite and foreach is None:
            # torch's clip bit for bit, its norms handed to the monitor: no pass of the monitor's own
            total = clip_gradients(parameters, max_norm, self._monitor.after_backward)
        else:
            if reading:
                self._monitor.after_backward()
            total = original(parameters, max_norm, norm_type, error_if_nonfinite, foreach)
        self._gradients_read = self._gradients_read or reading
        self._grad_norm = total
        return total

    def _before_step(self, optimizer, args, kwargs) -> None:
        if optimizer is self.optimizer and self.model is not None:
            self._lr = float(optimizer.param_groups[0]["lr"])

    @_one_line
    def _after_step(self, optimizer, args, kwargs) -> None:
        if optimizer is not self.optimizer or self.model is None:
            return
        losses = [float(loss) for loss in self._losses]
        loss = sum(losses) / len(losses) if losses else None
        grad_norm = float(self._grad_norm) if self._grad_norm is not None else None
        if self._dumper is not None:  # every step's, as `run` records them: the dump's loss curves
            self._dumper.record_metrics(self.step, loss=math.nan if loss is None else loss, grad_norm=grad_norm,
                                        lr=self._lr)
        if self._dumping:
            self._dumper.stop()
            self._dumper.step()
            self._dumping = False
        if self._monitor is not None:
            self._monitor.step()
        if loss is not None and rank_and_world_size()[0] == 0:
            step_time = time.perf_counter() - self._step_started if self._step_started is not None else math.nan
            record = {"step": self.step, "loss": loss, "grad_norm": grad_norm, "lr": self._lr, "step_time_s": step_time}
            with (self.out / LOG).open("a") as log:
                log.write(json.dumps(record) + "\n")
        self._losses.clear()
        self._grad_norm, self._step_started, self._gradients_read = None, None, False
        self.step += 1
        # at exit, close() hands what is pending (the metrics of steps after the last dumped one) to
        # the writers before their own exit handlers close them: atexit runs the last registered first
        atexit.unregister(self.close)
        atexit.register(self.close)

    def close(self) -> None:
        """At the process's exit: every dump and monitor row written; the manifest completed with the
        training config the script saved (LeRobot's train_config.json), where it saved one."""
        if self._dumping:
            self._dumper.stop()
            self._dumping = False
        for part in (self._dumper, self._monitor):
            if part is not None:
                part.close()
        if self._manifest is not None and rank_and_world_size()[0] == 0:
            self._write_manifest({**self._manifest, **_saved_config(sys.argv)})

    # ---- helpers ---------------------------------------------------------------------------------

    def _wrap_forward(self, model: torch.nn.Module) -> None:
        """The model's forward, on the instance: each call begins the step's work (the dump starts
        there) and leaves its loss. A Dumper started inside wraps this wrapper in turn: the call
        then goes through it (`_inside` marks the way back in)."""
        own = model.__dict__.get("forward") or type(model).forward.__get__(model)

        @functools.wraps(own)
        def forward(*args, **kwargs):
            if self._inside:
                return own(*args, **kwargs)
            self._before_forward()
            current = model.__dict__.get("forward")
            if current is forward:
                output = own(*args, **kwargs)
            else:
                self._inside = True
                try:
                    output = current(*args, **kwargs)
                finally:
                    self._inside = False
            loss = _loss_of(output)
            if loss is not None:
                self._losses.append(loss.detach())
            return output

        model.__dict__["forward"] = forward

    def _named(self, found: torch.nn.Module) -> torch.nn.Module:
        """--model-attr: a dotted path from the module found, else from the script's globals."""
        path = self.settings.model_attr
        for root in (found, sys.modules.get("__main__")):
            value = functools.reduce(lambda obj, name: getattr(obj, name, None), path.split("."), root)
            if isinstance(value, torch.nn.Module):
                return value
        raise UserError(f"--model-attr {path}: no module at {path} of the {type(found).__name__} the first optimizer "
                        "trains, nor among the script's globals")

    def _build_manifest(self) -> dict:
        parameter = next(self.model.parameters(), None)
        where = parameter.device if parameter is not None else torch.device("cpu")
        rank, world_size = rank_and_world_size()
        manifest = {
            **environment(Device(where.type, where.index), rank, world_size),
            "seed": self.settings.seed, "seed_impl": self.seed_impl,
            "attached": {"command": list(self.settings.command), "argv": sys.argv,
                         "seed_forced": self.settings.seed is not None, "model": type(self.model).__qualname__,
                         "optimizer": type(self.optimizer).__qualname__},
            "parameter_count": sum(p.numel() for p in self.model.parameters()),
            "weights_sha256": weights_sha256(self.model),
            "started": datetime.now().isoformat(timespec="seconds"),
        }
        if rank == 0:
            self._write_manifest(manifest)
        return manifest

    def _write_manifest(self, manifest: dict) -> None:
        (self.out / MANIFEST).write_text(json.dumps(manifest, indent=2, default=str) + "\n")


def _wrap(owner, name: str, handler, original=None) -> None:
    """owner.name replaced by a function calling `handler(original, ...)` (for __init__: after it)."""
    original = original or getattr(owner, name)
    if name == "__init__":
        @functools.wraps(original)
        def wrapper(self, *args, **kwargs):
            original(self, *args, **kwargs)
            handler(self)
    else:
        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            return handler(original, *args, **kwargs)
    setattr(owner, name, wrapper)


def _module_holding(parameters: set[int]) -> torch.nn.Module | None:
    """The module whose parameters include all of `parameters`: the one with the fewest, and among
    those the outermost (a policy rather than the network it wraps, which holds the same)."""
    holding = []
    for candidate in gc.get_objects():
        if issubclass(type(candidate), torch.nn.Module):  # type(): no object's own __class__ runs
            own = {id(p) for p in candidate.parameters()}
            if parameters <= own:
                holding.append((len(own), -sum(1 for _ in candidate.modules()), id(candidate), candidate))
    return min(holding, key=lambda entry: entry[:3])[3] if holding else None


def _loss_of(output) -> torch.Tensor | None:
    """The loss a model's output carries: the output itself, its first element (LeRobot's policies
    return `(loss, outputs)`), its `loss` key or attribute; a floating tensor of one element."""
    candidates = [output]
    if isinstance(output, (tuple, list)) and output:
        candidates.append(output[0])
    if isinstance(output, dict):
        candidates.append(output.get("loss"))
    candidates.append(getattr(output, "loss", None))
    for candidate in candidates:
        if isinstance(candidate, torch.Tensor) and candidate.is_floating_point() and candidate.numel() == 1:
            return candidate
    return None


def _saved_config(argv: list[str]) -> dict:
    """The set-up LeRobot saved (train_config.json under the script's --output_dir), as manifest keys."""
    from pi0align.runs.folder import read_run

    for index, argument in enumerate(argv):
        name, _, value = argument.partition("=")
        if name == "--output_dir":
            folder = Path(value or (argv[index + 1] if index + 1 < len(argv) else ""))
            try:
                run = read_run(folder)
            except UserError:
                return {}
            return run.manifest if run.kind == "LeRobot training config" else {}
    return {}


def attach_from_environment() -> Session | None:
    """The start-up hook's entry: a session installed when `pi0align attach` set one up."""
    settings = AttachSettings.from_environment()
    if settings is None:
        return None
    session = Session(settings)
    session.install()
    return session
