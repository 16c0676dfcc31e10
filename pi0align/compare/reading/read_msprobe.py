"""Reader of msprobe (mindstudio-probe, PyTorch) dump folders: `step*/rank*/dump.json`, with
`stack.json`, `construct.json` and, in tensor mode, `dump_tensor_data/*.pt|*.npy` beside it.

msprobe names calls `<Prefix>.<api>.<k>.<forward|backward>` with one counter per API across the
whole model, and modules `Module.<path>.<Class>.<forward|backward>.<k>`. We rename them to our
`<module>/<api>#<k>` (k counted per module), taking the module from construct.json (at level mix;
msprobe writes no module scopes at L1), so that both formats align the same way and an msprobe
dump compares against one of ours. msprobe records the API calls a step makes after its backward
(gradient clipping, the optimizer's arithmetic) as forward calls: they get the phase they ran in,
direction `in_optimizer` where their stack runs through an optimizer's step, `update` otherwise
(ours record the optimizer's update as one `Optimizer.step` call per parameter instead).
"""

from __future__ import annotations

import functools
import json
import math
import operator
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from pi0align.compare.reading.records import Dump, TensorRecord, call_site, no_metrics, no_records
from pi0align.compare.reading.sizes import check_tensor
from pi0align.compare.reading.torch_files import load_tensor
from pi0align.compare.table import Table
from pi0align.errors import UserError

_MODES = {"statistics": "stats", "tensor": "tensor"}
_FRAME = re.compile(r"File (?P<file>.*?), line (?P<line>\d+), in (?P<func>[^,\n]+)")
_PARAMETER_CALLS = 1 << 40  # call ids of parameters: after every real call, in first-seen order
_RANK_DIR = re.compile(r"^(rank|proc)(\d*)$")
_STATISTICS_FIELDS = ("Min", "Max", "Mean", "Norm")
_STATISTICS = operator.itemgetter(*_STATISTICS_FIELDS)
_SHAPE, _DTYPE = operator.itemgetter("shape"), operator.itemgetter("dtype")  # every tensor entry has both
# Frames of an optimizer's step: every torch.optim.Optimizer's (torch_npu's and DeepSpeed's fused ones
# derive from it) runs inside torch/optim; its learning-rate schedulers compute no tensors.
_OPTIMIZER_FILES = ("/torch/optim/", "/torch_npu/optim/")
_NOT_OPTIMIZER_STEP = ("/lr_scheduler.py:",)


def is_msprobe_path(path: Path) -> bool:
    if path.is_file():
        return path.name == "dump.json"
    return any(path.glob("dump.json")) or any(path.glob("*/dump.json")) or any(path.glob("step*/*/dump.json"))


def step_folders(path: Path) -> dict[int, tuple[tuple[int, Path], ...]]:
    """{rank: ((step, its folder), ...)} of an msprobe dump, found once: what `read_msprobe` reads."""
    by_rank: dict[int, list[tuple[int, Path]]] = {}
    for step, rank, folder in _step_folders(path):
        by_rank.setdefault(rank, []).append((step, folder))
    if not by_rank:
        raise UserError(f"{path}: no msprobe dump.json found (expected step*/rank*/dump.json)")
    return {rank: tuple(folders) for rank, folders in sorted(by_rank.items())}


def read_msprobe(path: Path, folders: dict[int, tuple[tuple[int, Path], ...]],
                 steps: set[int] | None = None) -> dict[int, Dump]:
    """{rank: Dump} of these ranks' step folders (`step_folders`), holding the records of `steps`
    (all when None; none where a rank holds none of them)."""
    return {rank: _read_rank(path, rank, [(step, folder) for step, folder in held if steps is None or step in steps])
            for rank, held in folders.items()}


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
    """orjson first (2-3x faster than json on msprobe's large dump.json); msprobe also writes
    `Infinity`, `-Infinity` and `NaN` (PI0's attention masks hold -2.4e38, so their means are -inf),
    which orjson refuses and the standard library reads."""
    try:
        raw = path.read_bytes()
    except OSError as error:
        raise UserError(f"{path}: cannot read msprobe JSON ({error.strerror})") from None
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        pass
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise UserError(f"{path}: cannot read msprobe JSON ({error})") from None


# What malformed msprobe JSON (a field missing, a value of another type) raises while it is read.
_MALFORMED = (KeyError, TypeError, ValueError, AttributeError, IndexError)


def _read_rank(root: Path, rank: int, folders: list[tuple[int, Path]]) -> Dump:
    tables, stacks, modes = [], {}, set()
    for step, folder in sorted(folders):
        dump = _load_json(folder / "dump.json")
        if not isinstance(dump, dict) or not isinstance(dump.get("data"), dict):
            raise UserError(f"{folder / 'dump.json'}: not an msprobe dump.json (no 'data' object)")
        task = dump.get("task", "")
        if not isinstance(task, str) or task not in _MODES:
            raise UserError(f"{folder / 'dump.json'}: msprobe task {task!r} is not supported "
                            f"(supported: {', '.join(_MODES)})")
        if dump.get("framework", "pytorch") != "pytorch":
            raise UserError(f"{folder / 'dump.json'}: msprobe framework {dump.get('framework')!r} is not supported")
        modes.add(_MODES[task])
        construct = _load_json(folder / "construct.json") if (folder / "construct.json").exists() else {}
        if not isinstance(construct, dict):
            raise UserError(f"{folder / 'construct.json'}: not an msprobe construct.json (not an object)")
        frames = _read_stacks(folder / "stack.json") if (folder / "stack.json").exists() else {}
        step_records = _StepRecords(step, construct, frames)
        try:
            step_records.read(dump["data"])
            tables.append(step_records.table(rank, folder / "dump_tensor_data"))
        except _MALFORMED as error:
            raise UserError(f"{folder / 'dump.json'}: not as msprobe writes it "
                            f"({type(error).__name__}: {error})") from None
        stacks.update(step_records.stacks)
    mode = "tensor" if modes == {"tensor"} else "stats"
    return Dump(source=str(root), mode=mode, rank=rank, records=Table.concat(tables) if tables else no_records(),
                metrics=no_metrics(), manifest={}, stacks=stacks,
                tensor_reader=_load_tensor)


def _load_tensor(record: TensorRecord):
    """One of msprobe's tensor files; what is not a tensor (a pickled object among them), or not
    the one its record in dump.json describes, is refused unread."""
    path = Path(record.path)
    expect = lambda shape, itemsize: check_tensor(shape, itemsize, record, str(path))  # noqa: E731
    try:
        if path.suffix != ".npy":
            return load_tensor(path, expect)
        array = np.load(path, mmap_mode="r")  # its header only: the elements are read as touched
        expect(array.shape, array.dtype.itemsize)
        return array
    except pickle.UnpicklingError:
        raise UserError(f"{path}: holds objects other than tensors (not msprobe's; never unpickled)") from None
    except (OSError, EOFError, KeyError, ValueError, zipfile.BadZipFile) as error:
        why = (str(error).splitlines() or [type(error).__name__])[0]
        raise UserError(f"{path}: not a tensor file as msprobe writes it ({why})") from None


def _read_stacks(path: Path) -> dict[str, tuple[str, ...]]:
    """call key -> frames innermost last. Accepts both stack.json layouts msprobe has written."""
    raw = _load_json(path)
    result = {}
    try:
        for key, value in raw.items():
            if isinstance(value, list) and len(value) == 2 and isinstance(value[0], list):
                names, frames = value  # newer: {"0": [[call keys], [frames]]}
            else:
                names, frames = [key], value  # older: {call key: [frames]}
            parsed = _frames(tuple(map(str, frames)))
            for name in names:
                result[name] = parsed
    except _MALFORMED as error:
        raise UserError(f"{path}: not as msprobe writes it ({type(error).__name__}: {error})") from None
    return result


@functools.lru_cache(maxsize=1 << 14)
def _frames(raw: tuple[str, ...]) -> tuple[str, ...]:
    """msprobe's frames ("File f, line n, in func, \\n code", innermost first) -> ours, innermost last."""
    return tuple(_frame(f) for f in reversed(raw))


def _frame(text: str) -> str:
    match = _FRAME.search(text)
    return f"{match['file']}:{match['line']} {match['func'].strip()}" if match else text.split("\n")[0]


def _parse_key(key: str) -> tuple[str, str, str, str]:
    """msprobe key -> (api, module path for Module calls else "", direction, forward key)."""
    if key.startswith("Module.") and key.count(".") >= 4:
        parts = key.split(".")
        direction = {"parameters_grad": "parameter"}.get(parts[-2], parts[-2])
        forward_key = ".".join(parts[:-2] + ["forward", parts[-1]])
        return f"Module.{parts[-3]}", ".".join(parts[1:-3]), direction, forward_key
    head, _, direction = key.rpartition(".")  # `<api>.<k>.<direction>`
    if direction in ("forward", "backward") and "." in head:
        return head.rpartition(".")[0], "", direction, key if direction == "forward" else head + ".forward"
    return key, "", "forward", key


def _tensors(value: Any) -> list[dict]:
    """Tensor entries of an argument, flattened depth-first (non-tensors skipped)."""
    if not value:
        return []
    if isinstance(value, dict):
        if "dtype" in value and "shape" in value:
            return [value] if str(value.get("type", "torch.Tensor")).endswith("Tensor") else []
        if str(value.get("type")).endswith("Tensor"):
            raise KeyError(f"a tensor entry without {'dtype' if 'shape' in value else 'shape'}")
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
    """A statistic: a number (a bool tensor's are bools), msprobe's text for one ("inf", "NaN"), or
    None where it has none."""
    if value is None:
        return float("nan")
    if not isinstance(value, (int, float, str)):
        raise TypeError(f"a statistic that is {type(value).__name__}: {value!r}")
    return float(value)  # ValueError for text that is not a number


class _StepRecords:
    """The records of one step's dump.json, gathered with as little work per tensor as possible.

    Per call: its id, name, module, API, direction and call site; per group of tensors of one call
    and role: the call, the role, how many; per tensor: msprobe's entry, whose fields are read in
    bulk at the end. A parameter (and its gradient) is a call of its own, numbered after every
    real call, as in our dumps.
    """

    def __init__(self, step: int, construct: dict, frames: dict[str, tuple[str, ...]]):
        self.step, self.construct, self.frames = step, construct, frames
        self.stacks: dict[tuple[int, int], tuple[str, ...]] = {}
        # id, name, module, api, direction, site, whether it ran inside an optimizer's step
        self.calls: list[tuple[int, str, str, str, str, str, bool]] = []
        self.groups: list[tuple[int, str, int]] = []  # position in self.calls, role, count
        self.entries: list[dict] = []
        self._forward_names: dict[str, str] = {}
        self._counts: dict[tuple[str, str], int] = {}
        self._parameter_calls: dict[str, int] = {}  # a parameter and its gradient form one call
        self._parameter_roles: set[tuple[str, str]] = set()

    def read(self, data: dict) -> None:
        call = 0
        for key, entry in data.items():
            api, own_path, direction, forward_key = _parse_key(key)
            module = own_path if api.startswith("Module.") else _module_of(self.construct.get(forward_key))
            if direction == "parameter":
                for pname, value in entry.items():
                    self._add_parameter(own_path, pname, "parameter_grad", value, key)
                continue
            name = self._forward_names.get(forward_key)
            if name is None:
                k = self._counts.get((module, api), 0)
                self._counts[(module, api)] = k + 1
                name = self._forward_names[forward_key] = f"{module}/{api}#{k}"
            frames = self.frames.get(key, ())
            self.stacks[(self.step, call)] = frames
            self.calls.append((call, name, module, api, direction, call_site(frames), _in_optimizer_step(frames)))
            if direction == "forward":
                self._add_tensors("input", _tensors(entry.get("input_args")) + _tensors(entry.get("input_kwargs")))
                self._add_tensors("output", _tensors(entry.get("output")))
            else:
                self._add_tensors("grad_output", _tensors(entry.get("input")))
                self._add_tensors("grad_input", _tensors(entry.get("output")))
            call += 1
            for pname, value in (entry.get("parameters") or {}).items():
                self._add_parameter(own_path, pname, "parameter", value, key)

    def _add_tensors(self, role: str, tensors: list[dict]) -> None:
        """Tensors of the call added last."""
        if tensors:
            self.groups.append((len(self.calls) - 1, role, len(tensors)))
            self.entries += tensors

    def _add_parameter(self, own_path: str, pname: str, role: str, value: Any, stack_key: str) -> None:
        tensors = _tensors(value)[:1]
        name = f"{own_path}.{pname}/Parameter#0"
        if not tensors or (name, role) in self._parameter_roles:
            return
        self._parameter_roles.add((name, role))
        call = self._parameter_calls.setdefault(name, _PARAMETER_CALLS + len(self._parameter_calls))
        self.calls.append((call, name, own_path, "Parameter", "parameter", call_site(self.frames.get(stack_key, ())),
                           False))
        self._add_tensors(role, tensors)

    def table(self, rank: int, tensor_dir: Path) -> Table:
        """The records, RECORD_COLUMNS."""
        entries, n = self.entries, len(self.entries)
        owners, roles, counts = (list(column) for column in zip(*self.groups)) if self.groups else ([], [], [])
        counts = np.array(counts, np.int64)
        of_call = np.repeat(np.array(owners, np.int64), counts)
        arg_index = np.arange(n) - np.repeat(np.cumsum(counts) - counts, counts)  # 0, 1, ... within a group
        ids, names, modules, apis, directions, sites, in_step = (
            [np.array(column, object) for column in zip(*self.calls)] if self.calls else [np.zeros(0, object)] * 7)
        call_ids, names, modules, apis, directions, sites = (
            column[of_call] for column in (ids, names, modules, apis, _update_phase(directions, in_step.astype(bool)),
                                           sites))
        shapes, numels = _shapes(list(map(_SHAPE, entries)))
        data_names = [entry.get("data_name") for entry in entries]  # tensor mode: the tensor's file
        return Table({
            "rank": np.full(n, rank, np.int64), "step": np.full(n, self.step, np.int64),
            "call": call_ids.astype(np.int64), "seq": call_ids.astype(np.int64), "name": names, "module": modules,
            "api": apis, "direction": directions, "role": np.repeat(np.array(roles, object), counts),
            "arg_index": arg_index, "dtype": _dtypes(list(map(_DTYPE, entries))), "shape": shapes, "numel": numels,
            **dict(zip(("min", "max", "mean", "norm"), _statistics(entries).T)),
            "nan_count": np.full(n, np.nan), "inf_count": np.full(n, np.nan), "stack": sites,
            "tensor": np.array([str(tensor_dir / d) if d else "" for d in data_names], object),
            "sample_row": np.full(n, -1, np.int64), "sample_count": np.zeros(n, np.int64),
            "checksum": np.full(n, -1, np.int64),
            "requires_grad": np.array([{True: 1, False: 0}.get(e.get("requires_grad"), -1) for e in entries],
                                      np.int64),
        }, length=n)


def _update_phase(directions: np.ndarray, in_optimizer_step: np.ndarray) -> np.ndarray:
    """The calls' directions, with `in_optimizer` for the forward calls that ran inside an
    optimizer's step (its arithmetic) and `update` for the other forward calls after the step's
    last backward call (what a step computes once its gradients are made: clipping)."""
    backward = np.flatnonzero(directions == "backward")
    directions = directions.copy()
    forward = directions == "forward"
    if len(backward):
        directions[forward & (np.arange(len(directions)) > backward[-1])] = "update"
    directions[forward & in_optimizer_step] = "in_optimizer"
    return directions


@functools.lru_cache(maxsize=1 << 12)  # the calls of one optimizer share a few stacks
def _in_optimizer_step(frames: tuple[str, ...]) -> bool:
    """Whether a call's frames (ours: "path:line function") run through an optimizer's step."""
    return any(any(part in frame for part in _OPTIMIZER_FILES)
               and not any(part in frame for part in _NOT_OPTIMIZER_STEP) for frame in frames)


def _statistics(entries: list[dict]) -> np.ndarray:
    """(n, 4) float64: msprobe's Min, Max, Mean, Norm of each tensor, NaN where one is not a number."""
    try:
        return np.array(list(map(_STATISTICS, entries)), np.float64).reshape(len(entries), 4)
    except (KeyError, TypeError, ValueError):  # None or text among them: one by one, to say which is wrong
        return np.array([[_number(e[field]) for field in _STATISTICS_FIELDS] for e in entries],
                        np.float64).reshape(len(entries), 4)


def _shapes(shapes: list) -> tuple[np.ndarray, np.ndarray]:
    """msprobe's shapes as our text ("[2, 3]") and element counts; each distinct shape parsed once."""
    distinct, codes = _factorize([tuple(shape or ()) for shape in shapes])
    dims = [[int(s) for s in shape] for shape in distinct]
    if any(n < 0 or n != s for shape, given in zip(dims, distinct) for n, s in zip(shape, given)) or \
            any(math.prod(shape) >= 1 << 62 for shape in dims):
        raise ValueError("a shape that is no tensor's")
    texts = np.array(["[" + ", ".join(map(str, d)) + "]" for d in dims], object)
    return texts[codes], np.array([math.prod(d) for d in dims], np.int64)[codes]


def _dtypes(dtypes: list) -> np.ndarray:
    """`torch.float32` -> `float32`, each distinct name converted once."""
    distinct, codes = _factorize(dtypes)
    return np.array([str(d).removeprefix("torch.") for d in distinct], object)[codes]


def _factorize(keys: list) -> tuple[list, np.ndarray]:
    """The distinct keys in order of first appearance, and the position of each key among them."""
    distinct = list(dict.fromkeys(keys))
    index = {key: code for code, key in enumerate(distinct)}
    return distinct, np.fromiter(map(index.__getitem__, keys), np.int64, len(keys))


@functools.lru_cache(maxsize=1 << 14)  # calls of one module share their parent
def _module_of(parent: str | None) -> str:
    """Module path of a construct.json parent node such as `Module.model.layers.0.Linear.forward.0`."""
    if not parent:
        return ""
    api, path, _, _ = _parse_key(parent)
    return path if api.startswith("Module.") else ""
