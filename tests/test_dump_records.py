"""A hand-built model with a known call sequence: the dump holds exactly the expected calls,
records, names, sequence numbers, backward records, parameters and their gradients, with
statistics and checksums equal to those of the real tensors."""

from __future__ import annotations

import collections
import gc
import json
import weakref

import h5py
import pytest
import torch
from conftest import require_native

from pi0align import Dumper
from pi0align.dump.capturing.capture import _ApiMode
from pi0align.testing import dump_helpers
from pi0align.testing.dump_helpers import Net, find, manifest, read_step, record_rows, reference_checksum, train_steps

torch.set_num_threads(1)

# the parameters (as the forward first reads them) and the batch open every dumped step
PARAMETERS = ("block.proj.weight", "block.proj.bias", "head.weight", "head.bias")
OPENING_CALLS = [(f"{p}/Parameter#0", "parameter") for p in PARAMETERS] + [("input/Data#0", "data")]
OPENING_RECORDS = [(f"{p}/Parameter#0", "parameter", role, 0) for p in PARAMETERS
                   for role in ("parameter", "parameter_grad")] + [("input/Data#0", "data", "output", 0)]

API_CALLS = OPENING_CALLS + [
    ("block.proj/Functional.linear#0", "forward"),
    ("block/Torch.tanh#0", "forward"),
    ("block.proj/Functional.linear#1", "forward"),
    ("block/Torch.tanh#1", "forward"),
    ("head/Functional.linear#0", "forward"),
    ("/Tensor.square#0", "forward"),
    ("/Tensor.mean#0", "forward"),
    ("/Tensor.mean#0", "backward"),
    ("/Tensor.square#0", "backward"),
    ("head/Functional.linear#0", "backward"),
    ("block/Torch.tanh#1", "backward"),
    ("block.proj/Functional.linear#1", "backward"),
    ("block/Torch.tanh#0", "backward"),
    ("block.proj/Functional.linear#0", "backward"),
]


def _linear(name, direction, x_has_grad=True):
    if direction == "forward":
        return [(name, direction, "input", 0), (name, direction, "input", 1), (name, direction, "input", 2),
                (name, direction, "output", 0)]
    return [(name, direction, "grad_output", 0)] + [(name, direction, "grad_input", i) for i in (0, 1, 2)
                                                     if i or x_has_grad]


def _unary(name, direction):
    return [(name, direction, "input", 0), (name, direction, "output", 0)] if direction == "forward" else \
        [(name, direction, "grad_output", 0), (name, direction, "grad_input", 0)]


API_RECORDS = (
    OPENING_RECORDS + _linear("block.proj/Functional.linear#0", "forward") + _unary("block/Torch.tanh#0", "forward")
    + _linear("block.proj/Functional.linear#1", "forward") + _unary("block/Torch.tanh#1", "forward")
    + _linear("head/Functional.linear#0", "forward") + _unary("/Tensor.square#0", "forward")
    + _unary("/Tensor.mean#0", "forward") + _unary("/Tensor.mean#0", "backward")
    + _unary("/Tensor.square#0", "backward") + _linear("head/Functional.linear#0", "backward")
    + _unary("block/Torch.tanh#1", "backward") + _linear("block.proj/Functional.linear#1", "backward")
    + _unary("block/Torch.tanh#0", "backward")
    + _linear("block.proj/Functional.linear#0", "backward", x_has_grad=False)
)

MIX_CALLS = OPENING_CALLS + [
    ("/Module.Net#0", "forward"),
    ("block/Module.Block#0", "forward"),
    ("block.proj/Module.Linear#0", "forward"),
    ("block.proj/Functional.linear#0", "forward"),
    ("block/Torch.tanh#0", "forward"),
    ("block/Module.Block#1", "forward"),
    ("block.proj/Module.Linear#1", "forward"),
    ("block.proj/Functional.linear#1", "forward"),
    ("block/Torch.tanh#1", "forward"),
    ("head/Module.Linear#0", "forward"),
    ("head/Functional.linear#0", "forward"),
    ("/Tensor.square#0", "forward"),
    ("/Tensor.mean#0", "forward"),
    ("/Tensor.mean#0", "backward"),
    ("/Tensor.square#0", "backward"),
    ("head/Functional.linear#0", "backward"),
    ("head/Module.Linear#0", "backward"),
    ("/Module.Net#0", "backward"),
    ("block/Torch.tanh#1", "backward"),
    ("block/Module.Block#1", "backward"),
    ("block.proj/Functional.linear#1", "backward"),
    ("block.proj/Module.Linear#1", "backward"),
    ("block/Torch.tanh#0", "backward"),
    ("block/Module.Block#0", "backward"),
    ("block.proj/Functional.linear#0", "backward"),
    ("block.proj/Module.Linear#0", "backward"),
]


@pytest.fixture(scope="module")
def dumped(tmp_path_factory, backend):
    """Two SGD steps of Net, step 1 dumped at levels api, module and mix; and the tensors of step 1."""
    base = tmp_path_factory.mktemp("records")
    torch.manual_seed(0)
    inputs = [torch.randn(3, 4), torch.randn(3, 4)]
    out = {}
    for level in ("api", "module", "mix"):
        torch.manual_seed(1)
        net = Net()
        train_steps(net, inputs, Dumper(base / level, steps=[1], level=level, manifest={"seed": 1}, backend=backend))
        out[level] = base / level / "dump.h5"
    # The same step without the dumper, keeping what the records must describe.
    torch.manual_seed(1)
    net = Net()
    train_steps(net, inputs[:1])
    params = {name: p.detach().clone() for name, p in net.named_parameters()}
    out_h = net.head(net.block(net.block(inputs[1])))
    loss = out_h.square().mean()
    loss.backward()
    grads = {name: p.grad.clone() for name, p in net.named_parameters()}
    out["expected"] = {"params": params, "grads": grads, "head_out": out_h.detach(), "loss": loss.detach()}
    return out


def test_api_level_calls_and_records_are_exactly_the_known_sequence(dumped):
    tables = read_step(dumped["api"], 1)
    calls = tables["calls"]
    assert list(zip(calls["name"], calls["direction"])) == API_CALLS
    assert calls["seq"] == list(range(len(API_CALLS))) and calls["call_id"] == list(range(len(API_CALLS)))
    assert record_rows(tables) == API_RECORDS
    modules = dict(zip(calls["name"], calls["module"]))
    assert modules["block.proj/Functional.linear#1"] == "block.proj" and modules["/Tensor.mean#0"] == ""
    assert modules["head.weight/Parameter#0"] == "head"
    assert set(calls["api"][5:8]) == {"Functional.linear", "Torch.tanh"}
    assert tables["attrs"]["complete"] and tables["attrs"]["step"] == 1


def test_mix_level_adds_module_calls_in_order_and_module_level_has_only_them(dumped):
    calls = read_step(dumped["mix"], 1)["calls"]
    assert list(zip(calls["name"], calls["direction"])) == MIX_CALLS
    module_calls = read_step(dumped["module"], 1)["calls"]
    assert list(zip(module_calls["name"], module_calls["direction"])) == [
        c for c in MIX_CALLS if "/Module." in c[0] or c[1] in ("parameter", "data")]


def test_statistics_and_checksums_are_those_of_the_real_tensors(dumped):
    tables, expected = read_step(dumped["api"], 1), dumped["expected"]
    records = tables["records"]

    def check(row, tensor):
        t = tensor.double()
        assert records["shape"][row] == json.dumps(list(tensor.shape)) and records["numel"][row] == tensor.numel()
        assert records["min"][row] == pytest.approx(t.min().item(), rel=1e-6)
        assert records["max"][row] == pytest.approx(t.max().item(), rel=1e-6)
        assert records["mean"][row] == pytest.approx(t.mean().item(), rel=1e-5, abs=1e-7)
        assert records["norm"][row] == pytest.approx(t.norm().item(), rel=1e-5)
        assert records["nan_count"][row] == 0 and records["inf_count"][row] == 0
        assert records["checksum"][row] == reference_checksum(tensor)

    for name, value in expected["params"].items():
        check(find(tables, f"{name}/Parameter#0", "parameter", "parameter"), value)
        check(find(tables, f"{name}/Parameter#0", "parameter", "parameter_grad"), expected["grads"][name])
    check(find(tables, "head/Functional.linear#0", "forward", "output"), expected["head_out"])
    check(find(tables, "/Tensor.mean#0", "forward", "output"), expected["loss"])
    # The head's weight is used once: the gradient flowing out of the call to it is its gradient.
    row = find(tables, "head/Functional.linear#0", "backward", "grad_input", 1)
    check(row, expected["grads"]["head.weight"])
    # A parameter read by a call is the same tensor as the parameter record: same statistics.
    param_row = find(tables, "head.weight/Parameter#0", "parameter", "parameter")
    input_row = find(tables, "head/Functional.linear#0", "forward", "input", 1)
    assert records["checksum"][input_row] == records["checksum"][param_row]


def test_arguments_stacks_metrics_and_root_attributes(dumped, backend):
    path = dumped["api"]
    tables = read_step(path, 1)
    calls = tables["calls"]
    args = json.loads(calls["args"][calls["name"].index("block.proj/Functional.linear#0")])
    assert args == {"args": [{"tensor": 0}, {"tensor": 1}, {"tensor": 2}], "kwargs": {}}
    with h5py.File(path, "r") as f:
        assert f.attrs["format"] == "pi0align-dump" and f.attrs["version"] == 1
        assert (f.attrs["mode"], f.attrs["level"], f.attrs["rank"], f.attrs["world_size"]) == ("stats", "api", 0, 1)
        assert f.attrs["backend"] == backend and f.attrs["backend_status"]
        assert list(f["steps"]) == ["000001"]
        stacks = dict(zip(f["stacks/stack_id"][()], (json.loads(s) for s in f["stacks/frames"][()])))
        assert list(f["metrics/step"][()]) == [0, 1]
        loss, lr = f["metrics/loss"][()], f["metrics/lr"][()]
    tanh_stack = stacks[calls["stack_id"][calls["name"].index("block/Torch.tanh#1")]]
    assert tanh_stack[-1].startswith(dump_helpers.__file__)
    assert tanh_stack[-1].endswith(" forward") and any("train_steps" in frame for frame in tanh_stack)
    assert calls["stack_id"][calls["name"].index("head.weight/Parameter#0")] == -1
    assert len(stacks) == len(set(c for c in calls["stack_id"] if c >= 0))  # once per call site
    assert tables["attrs"]["loss"] == loss[1] and lr[1] == 0.1
    meta = manifest(path)
    assert meta["seed"] == 1 and meta["device"] == "cpu" and meta["dtype"] == "float32"
    assert len(meta["weights_sha256"]) == 64 and meta["versions"]["torch"] and meta["world_size"] == 1


def test_include_and_exclude_patterns_select_records_by_name(tmp_path, backend):
    torch.manual_seed(1)
    net = Net()
    dumper = Dumper(tmp_path, steps=[0], level="api", include=["block*"], exclude=["*tanh*"], backend=backend)
    train_steps(net, [torch.randn(3, 4)], dumper)
    names = set(read_step(tmp_path / "dump.h5", 0)["calls"]["name"])
    assert names == {"block.proj/Functional.linear#0", "block.proj/Functional.linear#1",
                     "block.proj.weight/Parameter#0", "block.proj.bias/Parameter#0"}


def test_calls_of_a_module_named_beyond_ascii_are_named_as_written(tmp_path, backend):
    torch.manual_seed(1)
    net = torch.nn.Sequential(collections.OrderedDict([("крыло", torch.nn.Linear(4, 4)), ("tail", torch.nn.Tanh())]))
    train_steps(net, [torch.randn(3, 4)], Dumper(tmp_path, steps=[0], level="mix", backend=backend))
    names = set(read_step(tmp_path / "dump.h5", 0)["calls"]["name"])
    assert {"крыло/Module.Linear#0", "крыло/Functional.linear#0", "tail/Torch.tanh#0"} <= names


def test_stop_removes_everything_and_steps_not_chosen_install_nothing(tmp_path, backend):
    torch.manual_seed(1)
    net = Net()
    forwards = {name: m.forward for name, m in net.named_modules()}
    dumper = Dumper(tmp_path, steps=[1], level="mix", backend=backend)
    dumper.start(net)
    assert not torch._C._is_torch_function_mode_enabled()  # step 0 is not dumped: nothing installed
    assert all("forward" not in m.__dict__ for m in net.modules())
    dumper.step()
    assert torch._C._is_torch_function_mode_enabled() and all("forward" in m.__dict__ for m in net.modules())
    dumper.stop()
    assert not torch._C._is_torch_function_mode_enabled()
    assert all("forward" not in m.__dict__ for m in net.modules())
    assert {name: m.forward for name, m in net.named_modules()} == forwards
    assert all(not p._post_accumulate_grad_hooks for p in net.parameters())
    with h5py.File(tmp_path / "dump.h5", "r") as f:
        assert "steps" not in f or not list(f["steps"])  # nothing ran in step 1


@pytest.mark.parametrize("close_each_step", [False, True])
def test_msprobe_style_start_stop_around_each_step(tmp_path, backend, close_each_step):
    """Also with close() after each step: a later start() appends to the same file. What each
    start() installs is gone after its stop()."""
    torch.manual_seed(1)
    net = Net()
    earlier_modes = weakref.WeakSet(o for o in gc.get_objects() if isinstance(o, _ApiMode))  # other tests'
    dumper = Dumper(tmp_path, steps=[0, 1], level="api", backend=backend)
    for _ in range(2):
        x = torch.randn(3, 4)
        dumper.start(net)
        net(x).sum().backward()
        dumper.stop()
        dumper.step()
        if close_each_step:
            dumper.close()
    dumper.close()  # the writer process has written both steps
    gc.collect()  # no capture mode outlives its step
    assert not [o for o in gc.get_objects() if isinstance(o, _ApiMode) and o not in earlier_modes]
    for step in (0, 1):
        calls = read_step(tmp_path / "dump.h5", step)["calls"]
        assert calls["name"][:7] == [name for name, _ in OPENING_CALLS] + ["block.proj/Functional.linear#0",
                                                                            "block/Torch.tanh#0"]
        assert calls["direction"].count("backward") == 6


def test_gradient_accumulation_records_every_micro_batch_and_nothing_after_each_backward(tmp_path, backend):
    torch.manual_seed(1)
    net = Net()
    backward = torch.Tensor.backward
    with Dumper(tmp_path, steps=[0], level="api", backend=backend) as dumper:
        dumper.start(net)
        for _ in range(2):
            net(torch.randn(3, 4)).sum().backward()
            assert not torch._C._is_torch_function_mode_enabled()  # left until the model's next forward
            torch.ones(2).mul(3)  # not the model's: not recorded
        dumper.step()
    assert torch.Tensor.backward is backward
    calls = read_step(tmp_path / "dump.h5", 0)["calls"]
    forward = [name for name, direction in zip(calls["name"], calls["direction"]) if direction == "forward"]
    block, head = "block.proj/Functional.linear#", "head/Functional.linear#"
    assert [name for name in forward if "linear" in name] == [block + "0", block + "1", head + "0",
                                                              block + "2", block + "3", head + "1"]
    assert "Tensor.mul" not in calls["api"]
    assert calls["name"].count("block.proj.weight/Parameter#0") == 1


def test_optimizer_and_clipping_after_backward_are_not_recorded(dumped):
    apis = set(read_step(dumped["api"], 1)["calls"]["api"])
    assert not any(api.endswith(("add_", "mul_", "_foreach_add_", "norm")) for api in apis), apis


class _SharedWeight(torch.nn.Module):
    """One weight read by two calls: autograd puts the first gradient to reach it into `.grad` and
    adds the second to it there, in place."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(weight.clone())

    def forward(self, x):
        return torch.nn.functional.linear(torch.nn.functional.linear(x, self.weight).tanh(), self.weight).sum()


@pytest.mark.parametrize("mode", ["stats", "sample", "tensor"])
def test_a_shared_weight_s_gradients_are_recorded_as_they_came_and_its_gradient_as_their_sum(tmp_path, backend,
                                                                                            mode):
    torch.manual_seed(0)
    weight, x = torch.randn(4, 4), torch.randn(3, 4)
    inner, outer = (weight.clone().requires_grad_() for _ in range(2))
    first, second = torch.autograd.grad(
        torch.nn.functional.linear(torch.nn.functional.linear(x, inner).tanh(), outer).sum(), (inner, outer))
    net = _SharedWeight(weight)
    with Dumper(tmp_path, steps=[0], level="mix", mode=mode, backend=backend) as dumper:
        dumper.start(net)
        net(x).backward()
        dumper.step()
    tables = read_step(tmp_path / "dump.h5", 0)
    records = tables["records"]
    for name, gradient in (("/Functional.linear#0", first), ("/Functional.linear#1", second),
                           ("weight/Parameter#0", first + second)):
        row = find(tables, name, "backward", "grad_input", 1) if "linear" in name else \
            find(tables, name, "parameter", "parameter_grad")
        assert records["checksum"][row] == reference_checksum(gradient), name
        assert records["norm"][row] == pytest.approx(gradient.double().norm().item(), rel=1e-6), name
        if mode == "tensor":
            with h5py.File(tmp_path / "dump.h5", "r") as f:
                assert torch.equal(torch.from_numpy(f["steps/000000"][records["tensor"][row]][()]), gradient), name


@pytest.mark.parametrize("mode", ["stats", "sample", "tensor"])
def test_a_dumped_step_leaves_autograd_to_move_each_gradient_into_grad(tmp_path, mode):
    """As in a step not dumped: a gradient that something else still holds is copied into `.grad`
    instead (PI0 small: 23 MB a step, and the heap grown and trimmed again at each step)."""
    require_native()
    torch.manual_seed(0)
    net = Net()
    arriving = {}
    for name, param in net.named_parameters():
        param.register_hook(lambda gradient, name=name: arriving.__setitem__(name, gradient.data_ptr()))
    with Dumper(tmp_path, level="mix", mode=mode, backend="native") as dumper:
        dumper.start(net)
        for _ in range(2):  # the first step samples each layout through the Python sampler
            net.zero_grad(set_to_none=True)
            net(torch.randn(3, 4)).square().mean().backward()
            dumper.step()
            assert {name: p.grad.data_ptr() for name, p in net.named_parameters()} == arriving


def test_the_native_calls_table_holds_the_rows_that_steplog_s_own_holds():
    """The native backend opens a step's calls without a Python frame (csrc/calls_table.cpp):
    the same rows as StepLog's own methods, the reference, and the same error for a call that is
    not in the table."""
    from pi0align.dump.backends.steplog import StepLog
    from pi0align.dump.backends.torch_backend import TorchBackend

    backends = (TorchBackend("chosen"), require_native())
    logs = [StepLog(0, backend.records(True, None, None), None) for backend in backends]
    for log in logs:
        linear = log.open_call("block/Functional.linear#0", "block", "Functional.linear", "forward", 3, '{"args":[]}')
        assert log.open_call("input/Data#0", "", "Data", "data", -1, "{}") == 1
        assert log.open_backward(linear) == 2
        with pytest.raises(IndexError):
            log.open_backward(7)
    assert logs[1].records.calls_table is not None and logs[0].calls == logs[1].calls
    assert logs[1].calls["direction"] == ["forward", "data", "backward"]
