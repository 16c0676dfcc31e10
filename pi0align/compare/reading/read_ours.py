"""Reader of pi0align dump files (docs/dump-format.md), one file = one rank."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import h5py
import numpy as np

from pi0align.compare.reading.records import (
    CODED_COLUMNS,
    METRIC_COLUMNS,
    RECORD_COLUMNS,
    Bfloat16Array,
    Dump,
    TensorRecord,
    call_site,
    no_metrics,
    no_records,
)
from pi0align.compare.reading.sizes import check_length, check_stored, check_tensor
from pi0align.compare.table import Table, lookup
from pi0align.dump.file_format import CALL_TYPES, FORMAT, RECORD_TYPES, step_group
from pi0align.dump.file_format import VERSION as SUPPORTED_VERSION
from pi0align.dump.writing import journal
from pi0align.errors import UserError

# What compare reads at once: calls' arguments are read when asked for, records' skip reasons never.
_CALL_COLUMNS = [c for c in CALL_TYPES if c != "args"]
_RECORD_COLUMNS = [c for c in RECORD_TYPES if c != "skipped"]


OPEN_DATASETS = 64
LOCK_WAIT_S = 60.0  # how long a reader waits out an append in progress (one takes a second or so)


def dumped_steps(path: Path) -> tuple[int, dict[int, int]]:
    """(the file's rank, {step: its number of records} of the steps it holds, complete or not),
    without reading their records."""
    def read(f: h5py.File) -> tuple[int, dict[int, int]]:
        _check_format(f, path)
        steps = {}
        for key, group in f.get("steps", {}).items():
            records = group.get("records")
            role = records.get("role") if records is not None else None
            steps[int(group.attrs.get("step", int(key)))] = len(role) if role is not None else 0
        return int(f.attrs.get("rank", 0)), dict(sorted(steps.items()))

    return with_file(path, read)


def read_pi0align(path: Path, steps: set[int] | None = None) -> Dump:
    """Open one dump file; records are read now, tensors and samples later, on demand (the steps
    already complete never change, while a run may go on appending others)."""
    return with_file(path, lambda f: _read(f, path, steps), keep_open=True)


def with_file(path: Path, read, keep_open: bool = False, what: str = "pi0align dump"):
    """read(the open file), each problem one UserError naming the file (`what` it should be); the
    file closed after, or where `read` fails (`keep_open`: what it returns reads it later). A
    journal beside it (an append its writer was killed in) is rolled back first."""
    try:
        with journal.reading(path, LOCK_WAIT_S):
            return _open(path, read, keep_open, what)
    except BlockingIOError:
        raise UserError(f"{path}: being written (its writer has been inside one append for over {LOCK_WAIT_S:.0f} s); "
                        "try again when it has moved on") from None
    except journal.DamagedJournal as error:
        raise UserError(f"{journal.journal_path(path)}: damaged ({error}); the dump was left as it is: move the "
                        "journal away to read it as it stands") from None
    except journal.InterruptedAppend as error:
        raise UserError(f"{path}: its writer was killed in the middle of an append, which cannot be undone here "
                        f"({error}); open it once with write access to restore its last complete step") from None
    except OSError as error:
        raise UserError(f"{path}: cannot open it ({error.strerror or error})") from None


def _open(path: Path, read, keep_open: bool, what: str):
    try:
        f = h5py.File(path, "r", locking=False)  # the writer's lock is journal.py's, never held long
    except OSError as error:
        raise UserError(f"{path}: cannot open as HDF5 ({error})") from None
    try:
        result = read(f)
    except UserError:
        f.close()
        raise
    except (KeyError, ValueError, OSError, json.JSONDecodeError) as error:
        f.close()
        raise UserError(f"{path}: corrupt {what} ({error})") from None
    if not keep_open:
        f.close()
    return result


def _check_format(f: h5py.File, path: Path) -> None:
    fmt = _text(f.attrs.get("format", ""))
    if fmt != FORMAT:
        raise UserError(f"{path}: not a pi0align dump (format {fmt!r}, expected {FORMAT!r})")
    version = int(f.attrs.get("version", 0))
    if version > SUPPORTED_VERSION:
        raise UserError(f"{path}: dump format version {version} is newer than this pi0align reads "
                        f"({SUPPORTED_VERSION}); upgrade pi0align")


def _read(f: h5py.File, path: Path, steps: set[int] | None) -> Dump:
    _check_format(f, path)
    rank = int(f.attrs.get("rank", 0))
    notes, frames_of = [], _stacks(f)
    tables, stacks = [], {}
    texts: dict[str, str] = {}  # one str object per distinct text, shared by every step's records
    for key in sorted(f.get("steps", {})):
        group = f["steps"][key]
        step = int(group.attrs.get("step", int(key)))
        if steps is not None and step not in steps:
            continue
        if not bool(group.attrs.get("complete", True)):
            notes.append(f"{path.name}: step {step} is incomplete (run stopped while writing it); skipped")
            continue
        table, step_stacks = _step_records(group, step, rank, frames_of, texts)
        if "tensors" in group and group.get("tensors") is None:  # the link leads to no file (yet)
            table["tensor"] = np.full(len(table), "", dtype=object)
            missing = group.get("tensors", getlink=True).filename
            notes.append(f"{path.name}: step {step}'s full tensors are missing ({missing} not written: the run "
                         "ended first, or its writer is still at work); compared on statistics")
        tables.append(table)
        stacks.update(step_stacks)
    records = Table.concat(tables) if tables else no_records()

    # A step's tensor group (an external link, a file to open) is opened once; datasets are kept
    # open only while recent (the metrics read each once, the replay what recent calls made): an
    # open HDF5 dataset holds tens of kilobytes, thousands of them hundreds of megabytes.
    groups: dict[tuple[int, str], h5py.Group] = {}

    @functools.lru_cache(maxsize=OPEN_DATASETS)
    def tensor_reader(record: TensorRecord):
        import hdf5plugin  # noqa: F401 - registers the Zstandard filter the tensors are written with

        folder, _, name = record.path.rpartition("/")
        group = groups.get((record.step, folder))
        if group is None:
            step_tables = f[step_group(record.step)]
            group = groups[(record.step, folder)] = step_tables[folder] if folder else step_tables
        ds = group[name]
        if not isinstance(ds, h5py.Dataset):
            raise UserError(f"{path}: step {record.step}'s tensor {record.path}: damaged (not a dataset)")
        where = f"{ds.file.filename}: step {record.step}'s tensor {record.path}"
        check_tensor(ds.shape, ds.dtype.itemsize, record, where)
        check_stored(ds, where)
        return Bfloat16Array(ds) if _text(ds.attrs.get("dtype", "")) == "bfloat16" else ds

    def sample_reader(step: int) -> tuple[np.ndarray, np.ndarray]:
        group = f[step_group(step)]
        samples, records = group["samples"], len(group["records"]["role"])
        for name in ("values", "positions"):
            where = f"{path}: step {step}'s samples/{name}"
            if samples[name].ndim != 2 or samples[name].shape[0] != records:
                raise UserError(f"{where}: damaged (shape {list(samples[name].shape)} for {records} records)")
            check_stored(samples[name], where)
        return samples["values"][()], samples["positions"][()]

    args_of_step: dict[int, np.ndarray] = {}

    def args_reader(step: int, call: int) -> str:
        if step not in args_of_step:
            calls = f[step_group(step)]["calls"]
            args_of_step[step] = _column(calls, "args", length=len(calls["call_id"]))  # indexed by call_id
        return str(args_of_step[step][call])

    return Dump(source=str(path), mode=_text(f.attrs.get("mode", "stats")), rank=rank,
                records=records, metrics=_metrics(f), manifest=_manifest(f), stacks=stacks,
                tensor_reader=tensor_reader, sample_reader=sample_reader, args_reader=args_reader, notes=notes,
                close=f.close)


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _column(group: h5py.Group, name: str, texts: dict[str, str] | None = None, length: int | None = None) -> np.ndarray:
    """A dataset's values, once it is found to hold them (and `length` rows, where given); text as
    str, each distinct text one object from `texts` where given (a long dump repeats its names,
    dtypes and shapes at every step: a str per record would cost a compare of many steps most of
    its memory)."""
    ds = group[name]
    where = f"{group.file.filename}: {ds.name}"
    if length is None:
        if ds.ndim != 1:
            raise UserError(f"{where}: damaged (a column of shape {list(ds.shape)})")
        check_stored(ds, where)
    else:
        check_length(ds, length, where)
    if not h5py.check_string_dtype(ds.dtype):
        return ds[()]
    values = ds.asstr()[()]
    if texts is None:
        return values
    return np.fromiter((texts.setdefault(v, v) for v in values.tolist()), object, len(values))


def _step_records(group: h5py.Group, step: int, rank: int, frames_of: dict[int, list[str]], texts: dict[str, str]):
    calls = Table(_table(group["calls"], _CALL_COLUMNS, texts))
    records = Table(_table(group["records"], _RECORD_COLUMNS, texts))
    if len(np.unique(calls["call_id"])) != len(calls["call_id"]):
        raise ValueError("call ids repeat")
    of_call = lookup([records["call_id"]], [calls["call_id"]])
    if (of_call < 0).any():
        raise ValueError("records of calls that are not listed")
    for c in ("seq", "name", "module", "api", "direction"):
        records[c] = calls.coded(c).take(of_call) if c in CODED_COLUMNS else calls[c][of_call]
    for c in CODED_COLUMNS:  # role, dtype and shape: the records' own (the others coded above)
        records.coded(c)
    records["sample_row"] = np.arange(len(records)) if "samples" in group else -1
    records["call"], records["step"], records["rank"] = records["call_id"], step, rank
    records["requires_grad"] = np.full(len(records), -1, np.int64)  # not recorded: the batch has Data records
    site = {sid: call_site(frames) for sid, frames in frames_of.items()}
    records["stack"] = np.array([site.get(int(s), "") for s in calls["stack_id"]], object)[of_call]
    step_stacks = {(step, int(c)): frames_of.get(int(s), []) for c, s in zip(calls["call_id"], calls["stack_id"])}
    return records.select(RECORD_COLUMNS), step_stacks


def _table(group: h5py.Group, columns: list[str], texts: dict[str, str] | None = None) -> dict[str, np.ndarray]:
    """The columns of one table, all as long as its first."""
    first = _column(group, columns[0], texts)
    return {columns[0]: first, **{c: _column(group, c, texts, len(first)) for c in columns[1:]}}


def _stacks(f: h5py.File) -> dict[int, list[str]]:
    if "stacks" not in f:
        return {}
    stacks = _table(f["stacks"], ["stack_id", "frames"])
    return {int(i): json.loads(fr) for i, fr in zip(stacks["stack_id"], stacks["frames"])}


def _metrics(f: h5py.File) -> Table:
    columns = [c for c in METRIC_COLUMNS if c in f.get("metrics", {})]
    return Table(_table(f["metrics"], columns)) if columns else no_metrics()


def _manifest(f: h5py.File) -> dict:
    if "manifest" not in f:
        return {}
    raw = f["manifest"][()]
    return json.loads(_text(raw))
