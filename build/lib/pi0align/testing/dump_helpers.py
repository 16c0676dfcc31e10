"""Shared by the dump tests: a small hand-built model with a known call sequence, and readers of
a dump file's tables that use nothing but h5py and numpy (as the comparator does)."""

from __future__ import annotations

import json

import h5py
import numpy as np
import torch


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.tanh(self.proj(x))


class Net(torch.nn.Module):
    """`block` runs twice (call indices #0 and #1), `head` once; the loss is computed outside."""

    def __init__(self) -> None:
        super().__init__()
        self.block = Block()
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.block(self.block(x)))


def train_steps(net: Net, inputs: list[torch.Tensor], dumper=None, lr: float = 0.1) -> list[tuple[float, float]]:
    """SGD steps on `net`, one per input; (loss, grad norm) per step."""
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    if dumper is not None:
        dumper.start(net)
    results = []
    for step, x in enumerate(inputs):
        loss = net(x).square().mean()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        results.append((loss.item(), grad_norm.item()))
        if dumper is not None:
            dumper.record_metrics(step, loss, grad_norm, lr)
            dumper.step()
    if dumper is not None:
        dumper.stop()
        dumper.flush()  # the writer process has written every step
    return results


def read_step(path, step: int) -> dict:
    """{"calls": {column: list}, "records": {column: list}, "attrs": dict} with strings decoded."""
    with h5py.File(path, "r") as f:
        group = f[f"steps/{step:06d}"]
        tables = {table: {name: _column(group[table][name]) for name in group[table]} for table in ("calls", "records")}
        tables["attrs"] = dict(group.attrs)
        if "samples" in group:
            tables["samples"] = {name: group["samples"][name][()] for name in group["samples"]}
    return tables


def record_rows(tables: dict) -> list[tuple]:
    """(call name, direction, role, arg_index) per record, in file order."""
    calls, records = tables["calls"], tables["records"]
    return [(calls["name"][c], calls["direction"][c], role, int(arg))
            for c, role, arg in zip(records["call_id"], records["role"], records["arg_index"])]


def find(tables: dict, name: str, direction: str, role: str, arg_index: int = 0) -> int:
    """Row index of one record."""
    rows = record_rows(tables)
    return rows.index((name, direction, role, arg_index))


def reference_checksum(tensor: torch.Tensor) -> int:
    """docs/dump-format.md's checksum, written independently with numpy and Python integers."""
    flat = tensor.detach().contiguous().reshape(-1)
    width = flat.element_size()
    bits = flat.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[width]).numpy().astype(object)
    weights = np.arange(flat.numel(), dtype=np.int64) + 1
    total = int(sum(int(b) * int(w) for b, w in zip(bits, weights)))
    modulus = 1 << (64 if width == 8 else 32)
    total %= modulus
    return total - modulus if total >= modulus // 2 else total


def manifest(path) -> dict:
    with h5py.File(path, "r") as f:
        return json.loads(f["manifest"][()])


def _column(dataset: h5py.Dataset) -> list:
    """A column as a list; str columns (fixed- or variable-length) as str, as the format says."""
    return (dataset.asstr() if h5py.check_string_dtype(dataset.dtype) else dataset)[()].tolist()
