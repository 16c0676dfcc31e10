"""`pi0align.Monitor` in a training loop of one's own, and its per-parameter norms: the compiled pass
(CPU) against torch's multi-tensor kernels (its reference, what a GPU or NPU runs)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import without_compiler
from torch import nn

import pi0align
from pi0align.compare.reading.read_monitor import read_monitor
from pi0align.dump.monitoring.monitor import monitored_modules
from pi0align.dump.monitoring.monitor_file import QUANTITIES
from pi0align.dump.monitoring.parameter_norms import CompiledNorms, TorchNorms, parameter_norms


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Sequential(nn.Linear(16, 16), nn.Tanh()), nn.Linear(16, 2))


def column(monitored, quantity: str) -> np.ndarray:
    return monitored.values[:, :, QUANTITIES.index(quantity)]


def test_a_loop_of_ones_own_with_sgd_at_a_depth(tmp_path):
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    expected = []
    with pi0align.Monitor(tmp_path, net, optimizer=optimizer, depth=1) as monitor:
        monitor.start()
        for _ in range(3):
            net(torch.randn(4, 8)).square().mean().backward()
            monitor.after_backward()
            expected.append(math.sqrt(sum(float(p.grad.double().square().sum()) for p in net[0].parameters())))
            optimizer.step()
            optimizer.zero_grad()
            monitor.step()
    monitored = read_monitor(tmp_path / "monitor.h5")
    assert monitored.modules == ("0", "1", "2", "3") and monitored.steps.tolist() == [0, 1, 2]
    assert column(monitored, "grad_norm")[:, 0] == pytest.approx(expected, rel=1e-6)
    params = math.sqrt(sum(float(p.detach().double().square().sum()) for p in net[3].parameters()))
    assert column(monitored, "param_norm")[2, 3] == pytest.approx(params, rel=1e-6)  # after the last step
    assert np.isnan(column(monitored, "grad_norm")[:, 1]).all()  # GELU: an output, no parameter
    assert np.isfinite(column(monitored, "output_norm")).all()
    for quantity in ("update_norm", "exp_avg_norm", "exp_avg_sq_norm"):  # SGD keeps no moments
        assert np.isnan(column(monitored, quantity)).all()
    assert (tmp_path / "alerts.jsonl").exists() is False  # no rules given, no alerts


def test_the_default_modules_are_those_holding_parameters_and_each_layer_of_a_list():
    assert [path for path, _ in monitored_modules(model())] == ["0", "2.0", "3"]
    stack = nn.Module()
    stack.layers = nn.ModuleList([nn.Sequential(nn.Linear(2, 2)), nn.Sequential(nn.ReLU())])
    stack.head = nn.Linear(2, 1)
    assert [path for path, _ in monitored_modules(stack)] == ["layers.0", "layers.1", "head"]


def adam_states(dtype: torch.dtype = torch.float32) -> tuple[torch.optim.Optimizer, list]:
    """AdamW after two steps on parameters of many sizes, a non-contiguous one, one without a
    gradient, moments with NaN, Inf and zeros in them."""
    torch.manual_seed(1)
    parameters = [nn.Parameter(torch.randn(n, dtype=dtype)) for n in (1, 15, 16, 17, 2047, 2049, 70_001)]
    parameters.append(nn.Parameter(torch.randn(6, 5, dtype=dtype).t()))
    untouched = nn.Parameter(torch.randn(9, dtype=dtype))
    optimizer = torch.optim.AdamW([*parameters, untouched], lr=1e-3, eps=1e-6)
    for _ in range(2):
        for p in parameters:
            p.grad = torch.randn_like(p) * (p.detach().abs() > 0.1)
        optimizer.step()
    with torch.no_grad():
        optimizer.state[parameters[4]]["exp_avg"][3] = math.nan
        optimizer.state[parameters[5]]["exp_avg_sq"][7] = math.inf
        optimizer.state[parameters[6]]["exp_avg_sq"][:100] = 0
    return optimizer, [*parameters, untouched]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_norms_are_torchs(dtype):
    compiled = parameter_norms(torch.device("cpu"))
    if not isinstance(compiled, CompiledNorms):
        pytest.skip(f"no compiler here: {compiled.status}")
    optimizer, parameters = adam_states(dtype)
    with torch.no_grad():
        ours, reference = compiled.after_step(optimizer, parameters), TorchNorms().after_step(optimizer, parameters)
        grads = [p.grad for p in parameters]
        ours["grad_norm"], reference["grad_norm"] = compiled.norms(grads), TorchNorms().norms(grads)
    for quantity, norms in reference.items():
        mine = dict(zip(ours[quantity].at, ours[quantity].values.tolist()))
        theirs = dict(zip(norms.at, norms.values.double().tolist()))
        assert mine.keys() == theirs.keys(), quantity
        for index, value in theirs.items():
            if math.isfinite(value):
                # torch sums bfloat16 in bfloat16's own precision, and its ε of Adam's update in float32
                assert mine[index] == pytest.approx(value, rel=1e-2 if dtype == torch.bfloat16 else 1e-5), quantity
            else:
                assert str(mine[index]) == str(value), (quantity, index)  # nan or inf as torch's
    # the modules' outputs: norms and largest magnitudes, a NaN, an Inf, a strided one among them
    outputs = [p.detach() * -3 for p in parameters]
    outputs[4][5], outputs[5][9], outputs[6][:2] = math.nan, -math.inf, math.nan
    assert not outputs[7].is_contiguous()
    with torch.no_grad():
        (norms, largest), (torch_norms, torch_largest) = (each.norms_and_largest(outputs)
                                                          for each in (compiled, TorchNorms()))
    rel = 1e-2 if dtype == torch.bfloat16 else 1e-5
    for mine, theirs in zip(norms.tolist(), torch_norms.double().tolist()):
        assert mine == pytest.approx(theirs, rel=rel) if math.isfinite(theirs) else str(mine) == str(theirs)
    assert largest.tolist() == pytest.approx(torch_largest.double().tolist(), nan_ok=True, rel=0)
    assert math.isnan(largest[4]) and math.isinf(largest[5]) and math.isfinite(largest[3])


def test_a_tensors_norm_is_one_number_whichever_pass_and_threads_take_it():
    compiled = parameter_norms(torch.device("cpu"))
    if not isinstance(compiled, CompiledNorms):
        pytest.skip(f"no compiler here: {compiled.status}")
    optimizer, parameters = adam_states()
    found = []
    for threads in (1, 2, 3, 8):
        compiled.threads = threads
        with torch.no_grad():
            found.append((compiled.after_step(optimizer, parameters)["param_norm"].values.tolist(),
                          compiled.norms(parameters).values.tolist()))
    assert all(each == found[0] for each in found) and found[0][0] == found[0][1]


def test_without_a_compiler_torchs_kernels_run(tmp_path, monkeypatch):
    without_compiler(tmp_path, monkeypatch)
    assert isinstance(parameter_norms(torch.device("cpu")), TorchNorms)
