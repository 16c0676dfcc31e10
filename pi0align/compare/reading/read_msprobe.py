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
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from pi0align.compare.reading.msprobe_scan import (
    PARAMETER_ROLES,
    ROLES,
    TASK_MODES,
    TASKS,
    ScannedStep,
    parse_key,
    scanner,
    walk,
)
from pi0align.compare.reading.records import Dump, TensorRecord, call_site, no_metrics, no_records
from pi0align.compare.reading.sizes import check_tensor
from pi0align.compare.reading.torch_files import load_tensor
from pi0align.compare.table import Coded, Table, mapped
from pi0align.errors import UserError

_FRAME = re.compile(r"File (?P<file>.*?), line (?P<line>\d+), in (?P<func>[^,\n]+)")
_PARAMETER_CALLS = 1 << 40  # call ids of parameters: after every real call, in first-seen order
_RANK_DIR = re.compile(r"^(rank|proc)(\d*)$")
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


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as error:
        raise UserError(f"{path}: cannot read msprobe JSON ({error.strerror})") from None


def _load_json(path: Path, raw: bytes | None = None) -> Any:
    """orjson first (2-3x faster than json on msprobe's large dump.json); msprobe also writes
    `Infinity`, `-Infinity` and `NaN` (PI0's attention masks hold -2.4e38, so their means are -inf),
    which orjson refuses and the standard library reads."""
    raw = _read_bytes(path) if raw is None else raw
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        pass
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as error:
        raise UserError(f"{path}: cannot read msprobe JSON ({error})") from None


# What malformed msprobe JSON (a field missing, a value of another type, an argument nested deeper
# than Python recurses: orjson parses 1,024 levels) raises while it is read.
_MALFORMED = (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError, RecursionError)


def _scan_step(path: Path) -> ScannedStep:
    """A step's dump.json as columns: scanned, or where the scanner gives up on it, walked through
    as parsed (which reads it, or says how it is not msprobe's)."""
    raw = _read_bytes(path)
    compiled = scanner()
    scanned = compiled.scan(raw) if compiled is not None else None
    return scanned if scanned is not None else walked_step(path, raw)


def walked_step(path: Path, raw: bytes) -> ScannedStep:
    """The reference: a dump.json's bytes parsed and walked through (msprobe_scan.walk); UserError,
    in one line, where they are not msprobe's."""
    dump = _load_json(path, raw)
    if not isinstance(dump, dict) or not isinstance(dump.get("data"), dict):
        raise UserError(f"{path}: not an msprobe dump.json (no 'data' object)")
    task = dump.get("task", "")
    if not isinstance(task, str) or task not in TASKS:
        raise UserError(f"{path}: msprobe task {task!r} is not supported (supported: {', '.join(TASKS)})")
    if dump.get("framework", "pytorch") != "pytorch":
        raise UserError(f"{path}: msprobe framework {dump.get('framework')!r} is not supported")
    try:
        return walk(dump)
    except _MALFORMED as error:
        raise UserError(f"{path}: not as msprobe writes it ({type(error).__name__}: {error})") from None


def _read_rank(root: Path, rank: int, folders: list[tuple[int, Path]]) -> Dump:
    tables, stacks, modes = [], {}, set()
    for step, folder in sorted(folders):
        scanned = _scan_step(folder / "dump.json")
        modes.add(TASK_MODES[scanned.task])
        construct = _load_json(folder / "construct.json") if (folder / "construct.json").exists() else {}
        if not isinstance(construct, dict):
            raise UserError(f"{folder / 'construct.json'}: not an msprobe construct.json (not an object)")
        frames = _read_stacks(folder / "stack.json") if (folder / "stack.json").exists() else {}
        step_records = _StepRecords(step, construct, frames)
        try:
            step_records.read(scanned)
        except _MALFORMED as error:
            raise UserError(f"{folder / 'dump.json'}: not as msprobe writes it "
                            f"({type(error).__name__}: {error})") from None
        tables.append(step_records.table(rank, folder / "dump_tensor_data", scanned))
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


class _StepRecords:
    """The records of one step's scanned dump.json: the calls named, with their modules and call
    sites. A parameter (and its gradient) is a call of its own, numbered after every real call,
    as in our dumps."""

    def __init__(self, step: int, construct: dict, frames: dict[str, tuple[str, ...]]):
        self.step, self.construct, self.frames = step, construct, frames
        self.stacks: dict[tuple[int, int], tuple[str, ...]] = {}
        self.calls: tuple[list, ...] = ([], [], [], [], [], [])  # per call: id, name, module, api, direction, frames
        self.owner = np.zeros(0, np.int64)  # per group, its call's position in self.calls; -1: not kept
        self._forward_names: dict[str, str] = {}
        self._counts: dict[tuple[str, str], int] = {}
        self._parameter_calls: dict[str, int] = {}  # a parameter and its gradient form one call
        self._parameter_roles: set[tuple[str, int]] = set()

    def read(self, scanned: ScannedStep) -> None:
        roles, counts = scanned.group_role, scanned.group_count
        parameter = np.isin(roles, list(PARAMETER_ROLES))
        parameter_groups: dict[int, list[int]] = {}
        for group in np.flatnonzero(parameter & (counts > 0)).tolist():
            parameter_groups.setdefault(int(scanned.group_call[group]), []).append(group)
        self.owner = np.full(len(counts), -1, np.int64)
        position_of_call = [-1] * len(scanned.keys)
        ids, names, modules, apis, directions, frames_column = self.calls
        construct, frames_of, forward_names, counts_of = self.construct, self.frames, self._forward_names, self._counts
        stacks, step, call = self.stacks, self.step, 0
        for index, key in enumerate(scanned.keys):
            api, own_path, direction, forward_key = parse_key(key)
            if direction != "parameter":
                module = own_path if api.startswith("Module.") else _module_of(construct.get(forward_key))
                name = forward_names.get(forward_key)
                if name is None:
                    k = counts_of.get((module, api), 0)
                    counts_of[(module, api)] = k + 1
                    name = forward_names[forward_key] = f"{module}/{api}#{k}"
                position_of_call[index] = len(ids)
                ids.append(call), names.append(name), modules.append(module), apis.append(api)
                directions.append(direction), frames_column.append(frames_of.get(key, ()))
                stacks[(step, call)] = frames_column[-1]
                call += 1
            for group in parameter_groups.get(index, ()):
                self._add_parameter(own_path, scanned.group_parameter[group], group, int(roles[group]), key)
        tensors = ~parameter & (counts > 0)  # every group of a call's tensors is kept, with its call
        self.owner[tensors] = np.array(position_of_call, np.int64)[scanned.group_call[tensors]]

    def _add_parameter(self, own_path: str, pname: str, group: int, role: int, stack_key: str) -> None:
        name = f"{own_path}.{pname}/Parameter#0"
        if (name, role) in self._parameter_roles:
            return
        self._parameter_roles.add((name, role))
        call = self._parameter_calls.setdefault(name, _PARAMETER_CALLS + len(self._parameter_calls))
        self.owner[group] = len(self.calls[0])
        for column, value in zip(self.calls, (call, name, own_path, "Parameter", "parameter",
                                              self.frames.get(stack_key, ()))):
            column.append(value)

    def table(self, rank: int, tensor_dir: Path, scanned: ScannedStep) -> Table:
        """The records, RECORD_COLUMNS: the tensors of the groups kept, in order."""
        kept = np.flatnonzero(self.owner >= 0)
        counts = scanned.group_count[kept]
        n = int(counts.sum())
        group_starts = np.cumsum(scanned.group_count) - scanned.group_count
        arg_index = np.arange(n) - np.repeat(np.cumsum(counts) - counts, counts)  # 0, 1, ... within a group
        rows = np.repeat(group_starts[kept], counts) + arg_index  # each record's tensor in the scanned columns
        of_call = np.repeat(self.owner[kept], counts)
        ids, names, modules, apis, directions = (np.array(column, object) for column in self.calls[:5])
        stack_of_call, stacks = _shared(self.calls[5])
        in_step = np.array([_in_optimizer_step(f) for f in stacks], bool)[stack_of_call] & (directions != "parameter")
        sites = np.array([call_site(f) for f in stacks], object)[stack_of_call]
        call_ids, names, sites = (column[of_call] for column in (ids, names, sites))
        # CODED_COLUMNS: the calls' coded here, role, dtype and shape by the scan
        modules, apis, directions = (Coded.of(column).take(of_call)
                                     for column in (modules, apis, _update_phase(directions, in_step)))
        roles = Coded.of(np.array(ROLES, object))
        data_names = scanned.data_name[rows]
        return Table({
            "rank": np.full(n, rank, np.int64), "step": np.full(n, self.step, np.int64),
            "call": call_ids.astype(np.int64), "seq": call_ids.astype(np.int64), "name": names, "module": modules,
            "api": apis, "direction": directions,
            "role": roles.take(np.repeat(scanned.group_role[kept], counts)),
            "arg_index": arg_index, "dtype": scanned.dtype.take(rows), "shape": scanned.shape.take(rows),
            "numel": scanned.numel[rows], **dict(zip(("min", "max", "mean", "norm"), scanned.statistics[rows].T)),
            "nan_count": np.full(n, np.nan), "inf_count": np.full(n, np.nan), "stack": sites,
            "tensor": mapped(data_names, lambda name: str(tensor_dir / name) if name else ""),
            "sample_row": np.full(n, -1, np.int64), "sample_count": np.zeros(n, np.int64),
            "checksum": np.full(n, -1, np.int64), "requires_grad": scanned.requires_grad[rows],
        }, length=n)


def _shared(stacks: list[tuple[str, ...]]) -> tuple[np.ndarray, list[tuple[str, ...]]]:
    """The distinct objects among the calls' stacks (calls of one stack share its tuple: _frames),
    and each call's position among them."""
    _, first, position = np.unique(np.fromiter(map(id, stacks), np.uint64, len(stacks)), return_index=True,
                                          return_inverse=True)
    return position.reshape(-1), [stacks[i] for i in first.tolist()]


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


@functools.lru_cache(maxsize=1 << 14)  # calls of one module share their parent
def _module_of(parent: str | None) -> str:
    """Module path of a construct.json parent node such as `Module.model.layers.0.Linear.forward.0`."""
    if not parent:
        return ""
    api, path, _, _ = parse_key(parent)
    return path if api.startswith("Module.") else ""
