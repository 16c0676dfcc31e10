"""Reader of msprobe (mindstudio-probe, PyTorch) dump folders: `step*/rank*/dump.json`, with
`stack.json`, `construct.json` and, in tensor mode, `dump_tensor_data/*.pt|*.npy` beside it.

msprobe names calls `<Prefix>.<api>.<k>.<forward|backward>` with one counter per API across the
whole model, and modules `Module.<path>.<Class>.<forward|backward>.<k>`. We rename them to our
`<module>/<api>#<k>` (k counted per module), taking the module from construct.json, so that both
formats align the same way and an msprobe dump compares against one of ours.
"""

from __future__ import annotations

import functools
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pandas as pd

from pi0align.compare.records import RECORD_COLUMNS, Dump, call_site
from pi0align.errors import UserError

_MODES = {"statistics": "stats", "tensor": "tensor"}
_FRAME = re.compile(r"File (?P<file>.*?), line (?P<line>\d+), in (?P<func>[^,\n]+)")
_PARAMETER_CALLS = 1 << 40  # call ids of parameters: after every real call, in first-seen order
_RANK_DIR = re.compile(r"^(rank|proc)(\d*)$")


def is_msprobe_path(path: Path) -> bool:
    if path.is_file():
        return path.name == "dump.json"
    return any(path.glob("dump.json")) or any(path.glob("*/dump.json")) or any(path.glob("step*/*/dump.json"))


def read_msprobe(path: Path, steps: set[int] | None = None) -> dict[int, Dump]:
    """All ranks of an msprobe dump: {rank: Dump}."""
    by_rank: dict[int, list[tuple[int, Path]]] = {}
    for step, rank, folder in _step_folders(path):
        if steps is None or step in steps:
            by_rank.setdefault(rank, []).append((step, folder))
    if not by_rank:
        raise UserError(f"{path}: no msprobe dump.json found (expected step*/rank*/dump.json)")
    return {rank: _read_rank(path, rank, folders) for rank, folders in sorted(by_rank.items())}


def _step_folders(path: Path) -> list[tuple[int, int, Path]]:
    if path.is_file():
        path = path.parent
    if (path / "dump.json").exists():
        candidates = [path]
    elif any(path.glob("*/dump.json")):
        candidates = [p.parent for p in path.glob("*/dump.json")]
    else:
        candidates = [p.parent for p in path.glob("step*/*/dump.json")]
    found = []
    for folder in sorted(candidates):
        step_match = re.match(r"^step(\d+)$", folder.parent.name)
        rank_match = _RANK_DIR.match(folder.name)
        rank = int(rank_match.group(2)) if rank_match and rank_match.group(1) == "rank" and rank_match.group(2) else 0
        found.append((int(step_match.group(1)) if step_match else 0, rank, folder))
    return found


def _load_json(path: Path) -> Any:
    try:
        return orjson.loads(path.read_bytes())  # 2-3x faster than json on msprobe's large dump.json
    except (OSError, orjson.JSONDecodeError) as error:
        raise UserError(f"{path}: cannot read msprobe JSON ({error})") from None


def _read_rank(root: Path, rank: int, folders: list[tuple[int, Path]]) -> Dump:
    rows, stacks, modes = [], {}, set()
    for step, folder in sorted(folders):
        dump = _load_json(folder / "dump.json")
        if not isinstance(dump, dict) or not isinstance(dump.get("data"), dict):
            raise UserError(f"{folder / 'dump.json'}: not an msprobe dump.json (no 'data' object)")
        task = dump.get("task", "")
        if task not in _MODES:
            raise UserError(f"{folder / 'dump.json'}: msprobe task {task!r} is not supported "
                            f"(supported: {', '.join(_MODES)})")
        if dump.get("framework", "pytorch") != "pytorch":
            raise UserError(f"{folder / 'dump.json'}: msprobe framework {dump.get('framework')!r} is not supported")
        modes.add(_MODES[task])
        construct = _load_json(folder / "construct.json") if (folder / "construct.json").exists() else {}
        frames = _read_stacks(folder / "stack.json") if (folder / "stack.json").exists() else {}
        tensor_dir = folder / "dump_tensor_data"
        step_rows, step_stacks = _records(dump["data"], construct or {}, frames, step, rank, tensor_dir)
        rows.extend(step_rows)
        stacks.update(step_stacks)
    records = pd.DataFrame(rows, columns=RECORD_COLUMNS)
    mode = "tensor" if modes == {"tensor"} else "stats"

    return Dump(source=str(root), mode=mode, rank=rank, records=records,
                metrics=pd.DataFrame(columns=["step", "loss", "grad_norm", "lr"]),
                manifest={}, stacks=stacks, tensor_reader=lambda step, tensor: _load_tensor(Path(tensor)))


def _load_tensor(path: Path):
    if path.suffix == ".npy":
        return np.load(path, mmap_mode="r")
    import torch  # only for msprobe's .pt tensor files

    tensor = torch.load(path, map_location="cpu", weights_only=True)
    return tensor.float().numpy() if tensor.is_floating_point() else tensor.numpy()


def _read_stacks(path: Path) -> dict[str, list[str]]:
    """call key -> frames innermost last. Accepts both stack.json layouts msprobe has written."""
    raw = _load_json(path)
    result = {}
    for key, value in raw.items():
        if isinstance(value, list) and len(value) == 2 and isinstance(value[0], list):
            names, frames = value  # newer: {"0": [[call keys], [frames]]}
        else:
            names, frames = [key], value  # older: {call key: [frames]}
        parsed = _frames(tuple(frames))
        for name in names:
            result[name] = parsed
    return result


@functools.lru_cache(maxsize=1 << 14)
def _frames(raw: tuple[str, ...]) -> list[str]:
    """msprobe's frames ("File f, line n, in func, \\n code", innermost first) -> ours, innermost last."""
    return [_frame(f) for f in reversed(raw)]


def _frame(text: str) -> str:
    match = _FRAME.search(text)
    return f"{match['file']}:{match['line']} {match['func'].strip()}" if match else text.split("\n")[0]


def _parse_key(key: str) -> tuple[str, str, str, str]:
    """msprobe key -> (api, module path for Module calls else "", direction, forward key)."""
    parts = key.split(".")
    if parts[0] == "Module" and len(parts) >= 5:
        direction = {"parameters_grad": "parameter"}.get(parts[-2], parts[-2])
        forward_key = ".".join(parts[:-2] + ["forward", parts[-1]])
        return f"Module.{parts[-3]}", ".".join(parts[1:-3]), direction, forward_key
    if len(parts) >= 3 and parts[-1] in ("forward", "backward"):
        return ".".join(parts[:-2]), "", parts[-1], ".".join(parts[:-1] + ["forward"])
    return key, "", "forward", key


def _tensors(value: Any) -> list[dict]:
    """Tensor entries of an argument, flattened depth-first (non-tensors skipped)."""
    if isinstance(value, dict):
        if "dtype" in value and "shape" in value:
            return [value] if str(value.get("type", "torch.Tensor")).endswith("Tensor") else []
        value = list(value.values())
    if not isinstance(value, (list, tuple)):
        return []
    found = []
    for item in value:
        if type(item) is dict and "shape" in item and "dtype" in item:  # the common case, inline
            if str(item.get("type", "torch.Tensor")).endswith("Tensor"):
                found.append(item)
        else:
            found.extend(_tensors(item))
    return found


def _number(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("nan")


def _records(data: dict, construct: dict, frames: dict, step: int, rank: int, tensor_dir: Path):
    rows, stacks = [], {}
    names: dict[str, str] = {}
    counts: dict[tuple[str, str], int] = {}
    parameter_calls: dict[str, int] = {}  # a parameter and its gradient form one call, as in our dumps
    parameter_roles: set[tuple[str, str]] = set()
    call = 0

    def add_parameter(own_path, pname, role, entry, stack_key):
        name = f"{own_path}.{pname}/Parameter#0"
        if (name, role) in parameter_roles:
            return
        parameter_roles.add((name, role))
        parameter_call = parameter_calls.setdefault(name, _PARAMETER_CALLS + len(parameter_calls))
        add(name, own_path, "Parameter", "parameter", role, 0, entry, stack_key, parameter_call)

    sites: dict[str, str] = {}

    def add(name, module, api, direction, role, arg_index, entry, stack_key, call_id=None):
        call_id = call if call_id is None else call_id
        shape = [int(s) for s in entry.get("shape") or []]
        data_name = entry.get("data_name")
        if stack_key not in sites:
            sites[stack_key] = call_site(frames.get(stack_key, []))
        rows.append([rank, step, call_id, call_id, name, module, api, direction, role, arg_index,
                     str(entry.get("dtype", "")).removeprefix("torch."), "[" + ", ".join(map(str, shape)) + "]",
                     math.prod(shape),
                     _number(entry.get("Min")), _number(entry.get("Max")), _number(entry.get("Mean")),
                     _number(entry.get("Norm")), np.nan, np.nan, sites[stack_key],
                     str(tensor_dir / data_name) if data_name else "", -1, 0, -1])

    for key, entry in data.items():
        api, own_path, direction, forward_key = _parse_key(key)
        module = own_path if api.startswith("Module.") else _module_of(construct.get(forward_key))
        if direction == "parameter":
            for pname, value in entry.items():
                for t in _tensors(value)[:1]:
                    add_parameter(own_path, pname, "parameter_grad", t, key)
            continue
        if forward_key not in names:
            k = counts.get((module, api), 0)
            counts[(module, api)] = k + 1
            names[forward_key] = f"{module}/{api}#{k}"
        name = names[forward_key]
        stacks[(step, call)] = frames.get(key, [])
        if direction == "forward":
            roles = [("input", entry.get("input_args", [])), ("input", entry.get("input_kwargs", {})),
                     ("output", entry.get("output", []))]
        else:
            roles = [("grad_output", entry.get("input", [])), ("grad_input", entry.get("output", []))]
        index = {"input": 0, "output": 0, "grad_output": 0, "grad_input": 0}
        for role, value in roles:
            for t in _tensors(value):
                add(name, module, api, direction, role, index[role], t, key)
                index[role] += 1
        call += 1
        for pname, value in (entry.get("parameters") or {}).items():
            for t in _tensors(value)[:1]:
                add_parameter(own_path, pname, "parameter", t, key)
    return rows, stacks


def _module_of(parent: str | None) -> str:
    """Module path of a construct.json parent node such as `Module.model.layers.0.Linear.forward.0`."""
    if not parent:
        return ""
    api, path, _, _ = _parse_key(parent)
    return path if api.startswith("Module.") else ""
