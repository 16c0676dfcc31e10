"""Dump files for tests: a tiny residual tanh MLP trained with SGD in numpy, written as HDF5
exactly per docs/dump-format.md (pi0align-dump version 1).

The model really computes forward and backward, so an injected fault propagates downstream the
way it would in a real network. Typical use:

    steps = run_toy_model(seed=0)
    write_dump(tmp_path / "a.h5", steps, mode="stats")
    steps_b = run_toy_model(seed=0, fault=Fault("model.layers.1.linear/Functional.linear#0"))
    write_dump(tmp_path / "b.h5", steps_b, mode="stats")

Checksums and sample positions are the format's own (`pi0align.dump.file_format`). Also:
default_manifest(**overrides), Fault(name, direction, scale, noise), and
write_msprobe_dump(out, task=..., scale=...) for a real msprobe dump of a small torch MLP (needs
mindstudio-probe; runs in a child process).

Calls per step (forward, then backward in reverse, then parameters: msprobe's order; compare
orders a step by its phases, so ours, parameters first, reads the same):
    model.layers.<i>.linear/Functional.linear#0   inputs x, W, b -> y
    model.layers.<i>/Torch.tanh#0                 y -> h
    model.layers.<i>/Tensor.__add__#0             h, x -> out  (residual)
    model/Functional.mse_loss#0                   out, target -> loss
    <module>.weight/Parameter#0, .bias/...        parameter, parameter_grad
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np

from pi0align.dump import file_format
from pi0align.dump.file_format import checksum, sample_positions
from pi0align.dump.writing import dump_file
from pi0align.dump.writing.tensor_store import write_tensor_dataset


@dataclass
class Fault:
    """Corrupt one call's output on one side: scale it, and/or add relative Gaussian noise."""

    name: str
    direction: str = "forward"
    scale: float = 1.0 + 1e-3
    noise: float = 0.0


@dataclass
class Call:
    name: str
    module: str
    api: str
    direction: str
    records: list[tuple[str, int, np.ndarray]]  # (role, arg_index, value)
    stack: list[str] = field(default_factory=list)


@dataclass
class Step:
    step: int
    calls: list[Call]
    loss: float
    grad_norm: float
    lr: float


class _Recorder:
    """Collects calls of one step, naming them `<module>/<api>#<k>` per the format."""

    def __init__(self, fault: Fault | None, noise: float, rng: np.random.Generator):
        self.calls: list[Call] = []
        self.counts: dict[tuple[str, str, str], int] = {}
        self.fault, self.noise, self.rng = fault, noise, rng

    def _perturb(self, name: str, direction: str, out: np.ndarray) -> np.ndarray:
        # Rounding noise of another reduction order, then the injected fault (if this is the call).
        if self.noise:
            out = out * (1 + self.noise * self.rng.standard_normal(out.shape))
        if self.fault and self.fault.name == name and self.fault.direction == direction:
            out = out * self.fault.scale
            if self.fault.noise:
                out = out * (1 + self.fault.noise * self.rng.standard_normal(out.shape))
        return out.astype(np.float32)

    def forward(self, module: str, api: str, inputs: list[np.ndarray], out: np.ndarray) -> tuple[str, np.ndarray]:
        key = (module, api, "forward")
        k = self.counts.get(key, 0)
        self.counts[key] = k + 1
        name = f"{module}/{api}#{k}"
        out = self._perturb(name, "forward", out)
        records = [("input", i, x) for i, x in enumerate(inputs)] + [("output", 0, out)]
        self.calls.append(Call(name, module, api, "forward", records, _stack(module, api)))
        return name, out

    def backward(self, forward_name: str, module: str, api: str, grad_outputs: list[np.ndarray],
                 grad_inputs: list[np.ndarray]) -> list[np.ndarray]:
        grad_inputs = [self._perturb(forward_name, "backward", g) for g in grad_inputs]
        records = [("grad_output", i, g) for i, g in enumerate(grad_outputs)]
        records += [("grad_input", i, g) for i, g in enumerate(grad_inputs)]
        self.calls.append(Call(forward_name, module, api, "backward", records, _stack(module, api)))
        return grad_inputs

    def parameter(self, module: str, pname: str, value: np.ndarray, grad: np.ndarray) -> None:
        records = [("parameter", 0, value), ("parameter_grad", 0, grad)]
        self.calls.append(Call(f"{module}.{pname}/Parameter#0", module, "Parameter", "parameter", records))


def _stack(module: str, api: str) -> list[str]:
    line = 10 + sum(map(ord, api)) % 90  # one stable call site per API
    return ["train.py:42 train_step", f"toy_model.py:{line} forward"]


def run_toy_model(*, seed: int = 0, data_seed: int | None = None, steps: int = 1, layers: int = 3,
                  width: int = 16, batch: int = 4, lr: float = 0.05, fault: Fault | None = None,
                  fault_step: int = 0, extra_noop: str | None = None, noise: float = 0.0,
                  noise_seed: int = 1) -> list[Step]:
    """Train the toy model; return every call of every step.

    seed: initial weights; data_seed: the batches (defaults to seed); noise: relative rounding
    noise on every call's output (two runs with different noise_seed look like two thread
    counts); fault: corrupt one call at step fault_step; extra_noop: a module path that gets one
    extra `Tensor.__add__(x, 0)` call at the start of its forward (every step).
    """
    init = np.random.default_rng(seed)
    data = np.random.default_rng(seed if data_seed is None else data_seed)
    noise_rng = np.random.default_rng(noise_seed)
    weights = [(init.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32) for _ in range(layers)]
    biases = [(0.1 * init.standard_normal(width)).astype(np.float32) for _ in range(layers)]
    result = []
    for step in range(steps):
        x0 = data.standard_normal((batch, width)).astype(np.float32)
        target = data.standard_normal((batch, width)).astype(np.float32)
        rec = _Recorder(fault if step == fault_step else None, noise, noise_rng)
        x, saved = x0, []
        for i in range(layers):
            module = f"model.layers.{i}"
            if extra_noop == module:
                rec.forward(module, "Tensor.__add__", [x, np.zeros_like(x)], x + 0)
            lin, y = rec.forward(f"{module}.linear", "Functional.linear", [x, weights[i], biases[i]],
                                 x @ weights[i].T + biases[i])
            tanh, h = rec.forward(module, "Torch.tanh", [y], np.tanh(y))
            add, out = rec.forward(module, "Tensor.__add__", [h, x], h + x)
            saved.append((x, h, lin, tanh, add))
            x = out
        loss_name, loss = rec.forward("model", "Functional.mse_loss", [x, target],
                                      np.asarray(np.mean((x - target) ** 2), dtype=np.float32))
        (g,) = rec.backward(loss_name, "model", "Functional.mse_loss", [np.ones((), np.float32)],
                            [2 * (x - target) / x.size])
        grads_w, grads_b = [None] * layers, [None] * layers
        for i in reversed(range(layers)):
            module = f"model.layers.{i}"
            xi, h, lin, tanh, add = saved[i]
            g_h, g_skip = rec.backward(add, module, "Tensor.__add__", [g], [g, g])
            (g_y,) = rec.backward(tanh, module, "Torch.tanh", [g_h], [g_h * (1 - h * h)])
            g_x, grads_w[i], grads_b[i] = rec.backward(
                lin, f"{module}.linear", "Functional.linear", [g_y],
                [g_y @ weights[i], g_y.T @ xi, g_y.sum(axis=0)])
            g = (g_x + g_skip).astype(np.float32)
        for i in range(layers):
            rec.parameter(f"model.layers.{i}.linear", "weight", weights[i], grads_w[i])
            rec.parameter(f"model.layers.{i}.linear", "bias", biases[i], grads_b[i])
        grad_norm = float(np.sqrt(sum(float(np.sum(w.astype(np.float64) ** 2)) for w in grads_w + grads_b)))
        result.append(Step(step, rec.calls, float(loss), grad_norm, lr))
        weights = [(w - lr * gw).astype(np.float32) for w, gw in zip(weights, grads_w)]
        biases = [(b - lr * gb).astype(np.float32) for b, gb in zip(biases, grads_b)]
    return result


def default_manifest(**overrides) -> dict:
    manifest = {
        "device": "cpu", "device_name": "cpu", "device_count": 1, "dtype": "float32", "seed": 0,
        "seed_impl": "pi0align", "world_size": 1, "rank": 0,
        "versions": {"python": "3.11", "torch": None, "torch_npu": None, "cann": None, "transformers": None,
                     "lerobot": None, "deepspeed": None, "accelerate": None, "msprobe": None},
        "config": {"model": "toy"}, "weights_sha256": "0" * 64, "dataset_fingerprint": "toy", "git_commit": None,
    }
    manifest.update(overrides)
    return manifest


def _stats(value: np.ndarray) -> tuple[float, float, float, float, int, int]:
    v = value.astype(np.float64).reshape(-1)
    finite = v[np.isfinite(v)]
    nan_count, inf_count = int(np.isnan(v).sum()), int(np.isinf(v).sum())
    if finite.size == 0:
        return (np.nan,) * 4 + (nan_count, inf_count)
    return (float(finite.min()), float(finite.max()), float(finite.mean()),
            float(np.sqrt(np.sum(finite * finite))), nan_count, inf_count)


def write_dump(path: str | Path, steps: list[Step], *, mode: str = "stats", sample_size: int = 32,
               manifest: dict | None = None, rank: int = 0, world_size: int = 1, level: str = "api",
               version: int = file_format.VERSION, complete: bool = True) -> Path:
    """Write `steps` as one rank's pi0align dump file in `mode` (stats, sample or tensor), through
    the format module the dumper's writer uses."""
    path = Path(path)
    manifest = manifest or default_manifest(rank=rank, world_size=world_size)
    attrs = {"version": version, "rank": rank, "world_size": world_size, "mode": mode, "level": level,
             "sample_size": sample_size if mode == "sample" else 0, "backend": "test factory",
             "backend_status": "numpy"}
    dump_file.create(path, attrs, manifest)
    stack_ids: dict[tuple[str, ...], int] = {}
    for s in steps:
        tensors_file = None
        if mode == "tensor":
            tensors_file = file_format.tensors_file(path, s.step)
            (path.parent / tensors_file).parent.mkdir(parents=True, exist_ok=True)
        known = len(stack_ids)
        tables = step_tables(s, mode, sample_size, stack_ids, path.parent / tensors_file if tensors_file else None)
        stacks = [(i, json.dumps(list(frames))) for frames, i in stack_ids.items() if i >= known]
        dump_file.append(path, tables, stacks, [(s.step, s.loss, s.grad_norm, s.lr)], tensors_file)
        if not complete:
            with h5py.File(path, "a") as f:
                f[file_format.step_group(s.step)].attrs["complete"] = False
    return path


def step_tables(s: Step, mode: str, sample_size: int, stack_ids: dict,
                 tensors_path: Path | None) -> file_format.StepTables:
    calls = {k: [] for k in file_format.CALL_TYPES}
    records = {k: [] for k in file_format.RECORD_TYPES}
    sample_values, sample_positions_rows = [], []
    tensors = h5py.File(tensors_path, "w") if tensors_path is not None else None
    for call_id, call in enumerate(s.calls):
        stack_id = stack_ids.setdefault(tuple(call.stack), len(stack_ids)) if call.stack else -1
        for key, value in (("call_id", call_id), ("seq", call_id), ("name", call.name), ("module", call.module),
                           ("api", call.api), ("direction", call.direction), ("stack_id", stack_id),
                           ("args", json.dumps({"args": [], "kwargs": {}}))):
            calls[key].append(value)
        for role, arg_index, value in call.records:
            value = np.asarray(value)
            stats = _stats(value)
            tensor = ""
            if tensors is not None:
                tensor = f"tensors/{len(records['call_id'])}"
                write_tensor_dataset(tensors, tensor.removeprefix("tensors/"), value, str(value.dtype))
            count = 0
            if mode == "sample":
                positions = sample_positions(call.name, role, arg_index, value.shape, sample_size)
                count = len(positions)
                values = np.full(sample_size, np.nan)
                values[:count] = value.reshape(-1)[positions]
                padded = np.full(sample_size, -1, np.int32)
                padded[:count] = positions
                sample_values.append(values)
                sample_positions_rows.append(padded)
            row = dict(call_id=call_id, role=role, arg_index=arg_index, dtype=str(value.dtype),
                       shape=json.dumps(list(value.shape)), numel=value.size, min=stats[0], max=stats[1],
                       mean=stats[2], norm=stats[3], nan_count=stats[4], inf_count=stats[5],
                       checksum=checksum(value), sample_count=count, tensor=tensor, skipped="")
            for key, v in row.items():
                records[key].append(v)
    if tensors is not None:
        tensors.close()
    samples = None
    if mode == "sample":
        samples = (np.array(sample_values).reshape(-1, sample_size),
                   np.array(sample_positions_rows, np.int32).reshape(-1, sample_size))
    return file_format.StepTables(s.step, _arrays(calls, file_format.CALL_TYPES),
                                  _arrays(records, file_format.RECORD_TYPES), samples)


def _arrays(columns: dict[str, list], types: dict) -> dict[str, np.ndarray]:
    """Columns in the format's dtypes, str columns as object arrays (as the dumper hands them over)."""
    return {c: np.array(v, dtype=object if types[c] is file_format.STR else types[c]) for c, v in columns.items()}


MSPROBE_SCRIPT = '''
import json, sys, torch
from msprobe.pytorch import PrecisionDebugger
out, task, scale = sys.argv[1], sys.argv[2], float(sys.argv[3])
steps, width, depth = (int(value) for value in sys.argv[4:7])
options = {"scope": [], "list": [], "data_mode": ["all"]}
if task == "statistics":
    options["summary_mode"] = "statistics"
config = {"task": task, "dump_path": out, "rank": [], "step": [], "level": "mix", "async_dump": False, task: options}
with open(out + ".config.json", "w") as handle:
    json.dump(config, handle)

class Scale(torch.nn.Module):
    def forward(self, x):
        return x * scale

torch.manual_seed(0)
layers = []
for i in range(depth):
    layers += [torch.nn.Linear(width, width), Scale() if i == depth // 2 else torch.nn.Identity(), torch.nn.GELU()]
model = torch.nn.Sequential(*layers)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
debugger = PrecisionDebugger(config_path=out + ".config.json")
data = torch.Generator().manual_seed(1)
for step in range(steps):
    debugger.start(model=model)
    x = torch.randn(8, width, generator=data)
    loss = model(x).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    debugger.stop()
    debugger.step()
'''


def write_msprobe_dump(out: str | Path, *, task: str = "statistics", scale: float = 1.0, steps: int = 1,
                       width: int = 16, depth: int = 3, python: str | None = None) -> Path:
    """Dump a small torch MLP with msprobe's PrecisionDebugger (needs mindstudio-probe and torch).

    Runs in a child process, since msprobe patches torch globally. `scale` multiplies the output
    of one mid-network call (`Tensor.__mul__` inside the Scale module): 1.0 for the benchmark,
    1 + 1e-3 for a faulty run. task: "statistics" or "tensor".
    """
    import subprocess
    import sys

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([python or sys.executable, "-c", MSPROBE_SCRIPT, str(out), task, repr(scale), str(steps),
                    str(width), str(depth)], check=True, capture_output=True, text=True)
    return out
