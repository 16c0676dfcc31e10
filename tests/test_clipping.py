"""The training's clipping in two halves (pi0align/clipping.py) against torch's `clip_grad_norm_`,
and the monitor given the norms the clip computed."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import pi0align
from pi0align.clipping import clip_gradients
from pi0align.compare.reading.read_monitor import read_monitor
from pi0align.dump.monitoring.monitor_file import QUANTITIES

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
GRADIENT = st.tuples(st.integers(1, 3000), st.sampled_from(sorted(DTYPES)),
                     st.sampled_from(["normal", "none", "nan", "inf", "huge"]))


def parameters(specs: list[tuple[int, str, str]], seed: int) -> list[nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    made = []
    for size, dtype, kind in specs:
        parameter = nn.Parameter(torch.zeros(size, dtype=DTYPES[dtype]))
        if kind != "none":
            grad = torch.randn(size, generator=generator) * (1e18 if kind == "huge" else 1)
            if kind in ("nan", "inf"):
                grad[size // 2] = math.nan if kind == "nan" else -math.inf
            parameter.grad = grad.to(DTYPES[dtype])
        made.append(parameter)
    return made


@settings(max_examples=150, deadline=None)
@given(st.lists(GRADIENT, min_size=0, max_size=8), st.sampled_from([1e-3, 1.0, 1e9]), st.integers(0, 2**16))
def test_the_two_halves_clip_as_torch_does_bit_for_bit(specs, max_norm, seed):
    ours, theirs = parameters(specs, seed), parameters(specs, seed)
    seen = {}

    def before_scaling(norms):  # each gradient's norm, before any is scaled
        for parameter in ours:
            if parameter.grad is not None:
                seen[id(parameter.grad)] = (norms[id(parameter.grad)], parameter.grad.clone())

    total = clip_gradients(iter(ours), max_norm, before_scaling)
    expected = torch.nn.utils.clip_grad_norm_(iter(theirs), max_norm)
    assert torch.equal(total, expected) or (total.isnan() and expected.isnan())
    for mine, reference in zip(ours, theirs):
        assert (mine.grad is None) == (reference.grad is None)
        if mine.grad is not None:
            assert torch.equal(mine.grad.isnan(), reference.grad.isnan())
            assert torch.equal(mine.grad.nan_to_num(), reference.grad.nan_to_num())
            norm, before = seen[id(mine.grad)]
            expected_norm = torch.linalg.vector_norm(before)
            assert norm.dtype == before.dtype
            assert torch.equal(norm, expected_norm) or (norm.isnan() and expected_norm.isnan())


def test_the_monitor_takes_the_clips_norms_and_counts_what_the_clip_turns_nan(tmp_path):
    """Through the clip's norms: each gradient's norm before clipping (a bfloat16 one computed by the
    monitor itself); a gradient's NaN elements counted as the backward left them, though the clip
    by a NaN norm then makes every element NaN and zero_grad drops them before `step()`."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))
    net[2].to(torch.bfloat16)
    net[2].forward = lambda x: nn.functional.linear(x.bfloat16(), net[2].weight, net[2].bias).float()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    expected, planted = [], 5
    with pi0align.Monitor(tmp_path, net, optimizer=optimizer, depth=1) as monitor:
        monitor.start()
        for step in range(3):
            net(torch.randn(4, 8)).square().mean().backward()
            if step == 2:
                net[4].weight.grad.view(-1)[:planted] = math.nan
            expected.append([math.sqrt(sum(float(p.grad.double().square().sum()) for p in net[i].parameters()))
                             for i in (0, 2, 4)])
            clip_gradients(net.parameters(), 1e-3, monitor.after_backward)  # clips every step
            optimizer.step()
            optimizer.zero_grad()
            monitor.step()
    monitored = read_monitor(tmp_path / "monitor.h5")
    grad_norm = monitored.values[:, :, QUANTITIES.index("grad_norm")][:, [0, 2, 4]]
    np.testing.assert_allclose(grad_norm[:2], np.array(expected[:2]), rtol=1e-6)
    assert np.isnan(grad_norm[2, 2]) and grad_norm[2, :2] == pytest.approx(expected[2][:2], rel=1e-6)
    nonfinite = monitored.values[:, :, QUANTITIES.index("grad_nonfinite")][:, [0, 2, 4]]
    assert nonfinite.tolist() == [[0, 0, 0], [0, 0, 0], [0, 0, planted]]


def test_one_parameter_alone_is_clipped_as_torch_clips_it():
    ours, theirs = parameters([(40, "float32", "normal")], 3), parameters([(40, "float32", "normal")], 3)
    assert torch.equal(clip_gradients(ours[0], 0.5), torch.nn.utils.clip_grad_norm_(theirs[0], 0.5))
    assert torch.equal(ours[0].grad, theirs[0].grad)
