"""The two dump backends' hooks and records (native: csrc/capture_extension.cpp; torch: backward.py
and torch_backend.py) record exactly the same, on the awkward cases: an input passed twice, one
node with several outputs, views, an in-place call on a tensor that requires grad, a leaf input, a
composite call of many autograd nodes, module inputs and outputs, calls that write an argument by
keyword (`out=`, `inplace=True`: the native backend's C++ handler hands them to Python)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import require_native

from pi0align import Dumper
from pi0align.testing.dump_helpers import read_step, train_steps

pytestmark = pytest.mark.usefixtures("native")


@pytest.fixture(scope="module")
def native():
    """These tests compare the native backend with the torch one."""
    return require_native()


class Awkward(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 6)
        self.attention = torch.nn.MultiheadAttention(6, 2)  # F.multi_head_attention_forward: a composite
        self.scale = torch.nn.Parameter(torch.full((3,), 0.5))

    def forward(self, x):
        h = self.proj(x)
        squared = h * h  # one gradient edge, two arguments
        left, right = squared.chunk(2, dim=1)  # one node, two outputs
        mixed = left.t() @ right  # views
        mixed.add_(1.0)  # in place on a tensor that requires grad
        scaled = mixed * self.scale  # a leaf input
        attended, _ = self.attention(h[None], h[None], h[None])
        total = torch.zeros(6)
        for shift in (0.1, 0.2):  # an API's second call in a step runs on the plan its first made
            gate = torch.nn.functional.relu(h.detach() - shift, inplace=True)
            torch.sum(gate, dim=0, out=total)
        return scaled.tanh().sum() + attended.square().mean() + total.mean()


def dump_awkward(folder, level: str, mode: str = "stats", backend: str = "native") -> dict:
    torch.manual_seed(3)
    net = Awkward()

    class Wrapped(torch.nn.Module):  # train_steps takes the loss as the model output's square mean
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def forward(self, x):
            return self.net(x)

    inputs = [torch.randn(5, 4, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    with Dumper(folder, steps=[1], level=level, mode=mode, backend=backend) as dumper:
        train_steps(Wrapped(), inputs, dumper)
    return read_step(folder / "dump.h5", 1)


@pytest.mark.parametrize(("level", "mode"), [("api", "stats"), ("mix", "stats"), ("mix", "sample"), ("mix", "tensor")])
def test_both_backends_record_the_same(tmp_path, level, mode):
    compiled = dump_awkward(tmp_path / "compiled", level, mode)
    if mode != "stats":  # the hooks' own tensor work (samples, stored copies) is not captured
        assert compiled["calls"]["name"] == dump_awkward(tmp_path / "stats", level)["calls"]["name"]
    python = dump_awkward(tmp_path / "python", level, mode, backend="torch")
    for table in ("calls", "records"):
        assert compiled[table].keys() == python[table].keys()
        for column, values in compiled[table].items():
            values, expected = np.asarray(values), np.asarray(python[table][column])
            if column in ("mean", "norm"):  # float64 sums in two orders
                assert np.allclose(values, expected, rtol=1e-12, atol=0, equal_nan=True), column
            else:
                assert np.array_equal(values, expected, equal_nan=values.dtype.kind == "f"), column
    records, calls = compiled["records"], compiled["calls"]
    backward_calls = {i for i, d in enumerate(calls["direction"]) if d == "backward"}
    roles = {(calls["name"][c], r, a) for c, r, a in zip(records["call_id"], records["role"], records["arg_index"])
             if c in backward_calls}
    # x * x: the gradient reaches both arguments; chunk: both outputs' gradients arrive; a leaf's
    assert {("net/Tensor.mul#0", "grad_input", 0), ("net/Tensor.mul#0", "grad_input", 1)} <= roles
    assert {("net/Tensor.chunk#0", "grad_output", 0), ("net/Tensor.chunk#0", "grad_output", 1)} <= roles
    assert {("net/Tensor.mul#1", "grad_input", 1), ("net/Tensor.add_#0", "grad_input", 0)} <= roles
    written = {(calls["name"][c], r) for c, r in zip(records["call_id"], records["role"])}
    assert {("net/Functional.relu#1", "input"), ("net/Torch.sum#1", "input"), ("net/Torch.sum#1", "output")} <= written
    # the composite reports its output gradients only
    attention = {(r, a) for n, r, a in roles if n.endswith("Functional.multi_head_attention_forward#0")}
    assert ("grad_output", 0) in attention and not any(r == "grad_input" for r, _ in attention)


def test_the_tensors_of_a_call_are_found_alike_in_cpp_and_python(native):
    import collections
    from collections.abc import Mapping

    from pi0align.dump.capturing.arguments import tensors_of

    class Frozen(Mapping):  # a mapping that is not a dict
        def __init__(self, **items):
            self._items = items

        def __getitem__(self, key):
            return self._items[key]

        def __iter__(self):
            return iter(self._items)

        def __len__(self):
            return len(self._items)

    t = [torch.full((1,), float(i)) for i in range(8)]
    ordered = collections.OrderedDict(a=t[4], b=t[5])
    ordered.move_to_end("a")  # its values() order differs from its dict storage
    Pair = collections.namedtuple("Pair", "x y")
    values = ((t[0], 1, 2.5, None, "s", True, torch.Size([2])), {"k": [t[1], (t[2],)]},
              Pair(t[3], b"bytes"), ordered, Frozen(x=t[6], y=[t[7], 3]), t[0])
    expected = [t[0], t[1], t[2], t[3], t[5], t[4], t[6], t[7], t[0]]
    for found in (tensors_of(*values), native.tensors_of(*values)):
        assert [id(x) for x in found] == [id(x) for x in expected]
    assert native.tensors_of() == [] and native.tensors_of(7) == []
