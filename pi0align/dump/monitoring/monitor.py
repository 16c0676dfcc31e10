"""The monitor: at every step, cheaply, each monitored module's output, its parameters' gradients,
the parameters, their update and Adam's moments, as norms (docs/monitor-format.md); NaN/Inf and
sudden jumps as alerts (alerts.py). The Dumper's habits: `start`, `step`, `close`.

Cheap because nothing is read back per tensor: a module's output is kept as its forward returns it
(no work on the training thread), the gradients' norms are those the clipping computes where the
training hands them over (pi0align/clipping.py), and at the step's end every other norm is taken at
once, by torch's multi-tensor kernels on a GPU or NPU and by one compiled pass on a CPU
(parameter_norms.py); all are read back in one copy and gathered per module on the host; the row
goes to a writer process (writer_process.py) that appends it to `monitor.h5`. The monitor's own
work runs outside every TorchFunctionMode (a Dumper's, a noise reference's), adds no random draw and
changes no tensor: losses are bit for bit those of a run without it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from pi0align.dump.monitoring import monitor_file
from pi0align.dump.monitoring.alerts import Alert, AlertRules
from pi0align.dump.monitoring.parameter_norms import Norms, parameter_norms
from pi0align.dump.ranks import rank_and_world_size

_quiet = torch._C.DisableTorchFunction  # the monitor's work is no call of the run
_PRECISE = (torch.float32, torch.float64)  # a norm taken from the clipping (a bfloat16 one: too coarse)
Q = {name: i for i, name in enumerate(monitor_file.QUANTITIES)}


def monitored_modules(model: torch.nn.Module, depth: int | None = None) -> list[tuple[str, torch.nn.Module]]:
    """The modules monitored, in the order of the model's definition: at `depth` (the modules
    whose path has that many parts), or by default the blocks a person thinks in: each element of
    a ModuleList (a SigLIP layer, a Gemma layer of the language model or of the action expert),
    and, outside them, each module that holds parameters of its own (the projections, heads,
    embeddings and final norms). A model with none of those (a single layer, a depth past its
    deepest) is monitored whole, named by its class."""
    found = []
    if depth is not None:
        found = [(path, module) for path, module in model.named_modules() if path and path.count(".") + 1 == depth]
        return found or [(type(model).__name__, model)]

    def visit(path: str, module: torch.nn.Module) -> None:
        for name, child in module.named_children():
            child_path = f"{path}.{name}" if path else name
            if isinstance(module, torch.nn.ModuleList) or next(child.parameters(recurse=False), None) is not None:
                found.append((child_path, child))
            else:
                visit(child_path, child)

    visit("", model)
    return found or [(type(model).__name__, model)]


class Monitor:
    """Per step and per monitored module, the quantities of monitor_file.QUANTITIES, into
    `path` (a folder: `monitor.h5`, `monitor-rank<R>.h5` on several processes; or a `.h5` file).

    `depth`: the modules monitored (monitored_modules). `alerts`: the rules (alerts.AlertRules),
    their alerts printed and written to `alerts.jsonl` beside the file; None: no alerts."""

    def __init__(self, path: str | os.PathLike, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, depth: int | None = None,
                 alerts: AlertRules | None = None) -> None:
        self.path, self.depth, self.rules = Path(path), depth, alerts
        self.model, self.optimizer = model, optimizer
        self.current_step = 0
        self._modules: list[tuple[str, torch.nn.Module]] = []
        self._handles: list = []
        self._outputs: dict[int, torch.Tensor] = {}
        self._gradients: Norms | None = None  # per parameter, after backward
        self._gradients_nonfinite: dict[int, int] = {}  # per module, where a gradient's norm is not finite
        self._learning_rates: list[float] | None = None
        self._writer = None
        self._file: Path | None = None
        self._order: np.ndarray | None = None  # the modules (indices) in the order they ran, from the first step
        self.alerts: list[Alert] = []  # every alert so far

    @property
    def modules(self) -> list[str]:
        """The monitored modules' paths (once started): in the order they ran in the first step
        (the file's rows), those that returned no tensor last; until then the model's order."""
        order = self._order if self._order is not None else range(len(self._modules))
        return [self._modules[i][0] for i in order]

    @property
    def file(self) -> Path:
        """This rank's monitor file."""
        rank, world_size = rank_and_world_size()
        if self.path.suffix == ".h5":
            return self.path if world_size == 1 else self.path.with_stem(f"{self.path.stem}-rank{rank}")
        return monitor_file.monitor_path(self.path, rank, world_size)

    def start(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
              step: int | None = None) -> Monitor:
        """Hooks on the model's monitored modules (the file and its writer made at the first start);
        `step`: the step about to run (a resumed run's)."""
        self.model = model if model is not None else self.model
        self.optimizer = optimizer if optimizer is not None else self.optimizer
        if step is not None:
            self.current_step = step
        if self.model is None:
            raise ValueError("Monitor.start() needs the model")
        if not self._modules:
            self._find_modules()
        if not self._handles:
            for index, (_, module) in enumerate(self._modules):
                for part in (module, *module.children()):
                    self._handles.append(part.register_forward_hook(self._keeper(index)))
        return self

    def after_backward(self, gradient_norms: Mapping[int, torch.Tensor] | None = None) -> None:
        """The gradients' norms, as the backward (and its all-reduce) left them, before clipping, and
        the learning rates the step will use: call it between backward and the optimizer's step
        (`step()` reads `.grad` and the learning rates itself otherwise, as they are then).
        `gradient_norms`: {id(gradient): its L2 norm} that the clipping has computed already
        (pi0align/clipping.py); those in float32 or float64 are taken, the others computed here."""
        with torch.no_grad(), _quiet():
            gradients = [p.grad for p in self._parameters]
            if not gradient_norms:
                self._gradients = self._norms.norms(gradients)
            else:
                known = {i: gradient_norms.get(id(g)) for i, g in enumerate(gradients) if g is not None}
                known = {i: norm for i, norm in known.items() if norm is not None and norm.dtype in _PRECISE}
                rest = self._norms.norms([None if i in known else g for i, g in enumerate(gradients)])
                self._gradients = _joined(known, rest, self._device)
            self._gradients_nonfinite = self._nonfinite_gradients(gradients)
        # the learning rates the optimizer's step is about to use (a scheduler changes them after it)
        self._learning_rates = [float(g["lr"]) for g in self.optimizer.param_groups] if self.optimizer else None

    def step(self) -> list[Alert]:
        """After the optimizer's step: the row of this step, handed to the writer; its alerts."""
        if self._gradients is None:
            self.after_backward()
        with torch.no_grad(), _quiet():
            values, present = self._row()
        if self._writer is None:
            self._open()
        values, present = values[self._order], present[self._order]
        self._outputs.clear()
        self._gradients = self._learning_rates = None
        self._gradients_nonfinite = {}
        alerts = self.rules.check(self.current_step, self.modules, values, present) if self.rules is not None else []
        self._writer.append_monitor(self.current_step, values)
        self.alerts += alerts
        self.current_step += 1
        return alerts

    def stop(self) -> None:
        """Remove every hook."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._outputs.clear()

    def close(self) -> None:
        """stop(), and wait until every row is in the file."""
        self.stop()
        if self._writer is not None:
            writer, self._writer = self._writer, None
            writer.close()

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _find_modules(self) -> None:
        self._modules = monitored_modules(self.model, self.depth)
        owner = {}
        for index, (_, module) in enumerate(self._modules):
            for parameter in module.parameters():
                owner.setdefault(id(parameter), index)  # a shared parameter: the first module holding it
        self._parameters = [p for p in self.model.parameters() if id(p) in owner]
        self._device = self._parameters[0].device if self._parameters else torch.device("cpu")
        self._owners = np.array([owner[id(p)] for p in self._parameters], np.int64)  # each parameter's module
        self._norms = parameter_norms(self._device)

    def _open(self) -> None:
        """At the first step's end: the file, its rows the modules in the order they ran (each
        where its first hook fired: `_outputs` keeps that order), and the writer."""
        from pi0align.dump.writing.writer import DumpWriter

        ran = list(self._outputs)
        self._order = np.array(ran + [i for i in range(len(self._modules)) if i not in self._outputs], np.int64)
        rank, world_size = rank_and_world_size()
        self._file = self.file
        monitor_file.create(self._file, self.modules, {"rank": rank, "world_size": world_size})
        self._writer = DumpWriter(self._file, ring_bytes=1 << 16)
        if self.rules is not None:
            self.rules.open(self._file.parent / "alerts.jsonl")

    def _keeper(self, index: int):
        def keep(module, inputs, output) -> None:  # no tensor work here: a reference, read at the step's end
            found = output if isinstance(output, torch.Tensor) else next(
                (o for o in (output if isinstance(output, (tuple, list)) else ()) if isinstance(o, torch.Tensor)), None)
            if found is not None and found.is_floating_point():
                self._outputs[index] = found.detach()  # not its graph: the graph is freed as without a monitor
        return keep

    def _row(self) -> tuple[np.ndarray, np.ndarray]:
        """Every quantity of every module this step, (modules, quantities) float32, NaN where a
        module has none; and where it has one (a NaN there is a NaN computed)."""
        modules = len(self._modules)
        values = np.full((modules, len(Q)), np.nan)
        present = np.zeros((modules, len(Q)), bool)
        ran = [i for i in sorted(self._outputs) if self._outputs[i].numel()]
        per_tensor = {}  # quantity: per output, or per parameter that has it (Norms.at)
        if ran:
            per_tensor["output_norm"], per_tensor["output_max"] = self._norms.norms_and_largest(
                [self._outputs[i] for i in ran])
        quantities = {}
        if self._parameters:
            quantities = {"grad_norm": self._gradients, **self._norms.after_step(self.optimizer, self._parameters,
                                                                             self._learning_rates)}
            per_tensor |= {quantity: norms.values for quantity, norms in quantities.items() if norms.at}
        found = _read_back(per_tensor, self._device)
        if ran:
            values[ran, Q["output_norm"]], values[ran, Q["output_max"]] = found["output_norm"], found["output_max"]
            present[ran, Q["output_norm"]] = present[ran, Q["output_max"]] = present[ran, Q["output_nonfinite"]] = True
        for quantity, norms in quantities.items():  # per module: √(Σ norm²) over its parameters that have it
            if norms.at:
                owners = self._owners[norms.at]
                has = np.bincount(owners, minlength=modules) > 0
                squares = np.bincount(owners, np.square(found[quantity]), modules)
                values[has, Q[quantity]], present[has, Q[quantity]] = np.sqrt(squares[has]), True
        present[:, Q["grad_nonfinite"]] = present[:, Q["grad_norm"]]
        for count in ("output_nonfinite", "grad_nonfinite"):
            values[present[:, Q[count]], Q[count]] = 0
        # counted only where a norm says there are some: no pass over the elements otherwise
        for index in np.flatnonzero(present[:, Q["output_nonfinite"]] & ~np.isfinite(values[:, Q["output_norm"]])):
            values[index, Q["output_nonfinite"]] = int((~torch.isfinite(self._outputs[index])).sum())
        for index, count in self._gradients_nonfinite.items():
            values[index, Q["grad_nonfinite"]] = count
        return values.astype(np.float32), present

    def _nonfinite_gradients(self, gradients: list[torch.Tensor | None]) -> dict[int, int]:
        """Per module, the NaN/Inf elements of its gradients, where a gradient's norm is not finite
        (counted now, before clipping: a clip by a non-finite norm makes every element NaN)."""
        norms = self._gradients
        if not norms.at:
            return {}
        finite = torch.isfinite(norms.values).cpu().numpy()  # on a device, the step's one read back more
        counts: dict[int, int] = {}
        for index in np.flatnonzero(~finite).tolist():
            parameter = norms.at[index]
            module = int(self._owners[parameter])
            counts[module] = counts.get(module, 0) + int((~torch.isfinite(gradients[parameter])).sum())
        return counts


def _read_back(tensors: dict[str, torch.Tensor], device: torch.device) -> dict[str, np.ndarray]:
    """The step's one read back: each 1-D tensor, float64, in one copy."""
    if not tensors:
        return {}
    joined = torch.cat([t.to(device, torch.float64) for t in tensors.values()]).cpu().numpy()
    return dict(zip(tensors, np.split(joined, np.cumsum([len(t) for t in tensors.values()])[:-1])))


def _joined(known: dict[int, torch.Tensor], rest: Norms, device: torch.device) -> Norms:
    """Norms of the parameters in `known` ({index: 0-dim norm}) and in `rest`."""
    if not known:
        return rest
    values = torch.stack(list(known.values())).to(device, torch.float64)
    if not rest.at:
        return Norms(list(known), values)
    return Norms(list(known) + rest.at, torch.cat((values, rest.values.to(device, torch.float64))))
