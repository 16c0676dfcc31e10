"""Dumps made by the real Dumper on a real torch model, compared: the same run twice is aligned,
and a fault in one call of one module (its output scaled by 1 + 1e-3) is the first divergence and
the top culprit, in stats, sample and tensor mode."""

from __future__ import annotations

import pytest
import torch

from pi0align import Dumper
from pi0align.compare import compare_dumps

FAULTY = "blocks.1/Torch.mul#0"


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(width, width)
        self.scale = 1.0  # the faulty run's kernel computes this call 1e-3 too large

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(torch.mul(self.linear(x), self.scale))


class Model(torch.nn.Module):
    def __init__(self, width: int = 32, depth: int = 3) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(depth))
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def dumped_run(path, mode: str, fault: bool = False, level: str = "mix") -> None:
    """Two training steps from seed 0, both dumped."""
    torch.manual_seed(0)
    model = Model()
    if fault:
        model.blocks[1].scale = 1 + 1e-3
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    with Dumper(path, steps=[0, 1], level=level, mode=mode) as dumper:
        dumper.start(model)
        for _ in range(2):
            loss = model(data).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            dumper.step()


@pytest.mark.parametrize("mode", ["stats", "sample", "tensor"])
def test_same_run_twice_is_aligned_and_a_faulty_call_is_named(tmp_path, mode):
    torch.set_num_threads(1)
    for name, fault in (("a", False), ("same", False), ("fault", True)):
        dumped_run(tmp_path / name, mode, fault)

    same = compare_dumps(tmp_path / "a", tmp_path / "same")
    assert same.verdict == "aligned" and same.culprits == []
    assert (same.rows["verdict"] == "fail").sum() == 0 and set(same.rows["evidence"]) == {mode}

    result = compare_dumps(tmp_path / "a", tmp_path / "fault")
    assert result.verdict == "diverged"
    assert result.coverage["only_a"] == result.coverage["only_b"] == 0
    first = result.first_divergence
    assert (first.step, first.name, first.module, first.direction) == (0, FAULTY, "blocks.1", "forward")
    top = result.culprits[0]
    assert (top.step, top.name, top.direction) == (0, FAULTY, "forward")
    assert top.stack and "test_compare_real_dumps.py" in top.stack[-1]
    # every API call before the fault agrees; the modules around it (opened earlier) are not blamed
    rows = result.rows[(result.rows["step"] == 0) & (result.rows["direction"] == "forward")]
    before = rows["seq_a"] < rows.loc[rows["name"] == FAULTY, "seq_a"].min()
    api_before = before & ~rows["api"].str.startswith("Module.")
    assert api_before.any() and (rows.loc[api_before, "verdict"] == "pass").all()
    enclosing = {"/Module.Model#0", "blocks.1/Module.Block#0"}
    assert enclosing <= set(rows.loc[rows["verdict"] == "fail", "name"])
    assert not enclosing & {c.name for c in result.culprits}


def test_at_module_level_the_innermost_faulty_module_is_named(tmp_path):
    torch.set_num_threads(1)
    dumped_run(tmp_path / "a", "stats", level="module")
    dumped_run(tmp_path / "fault", "stats", fault=True, level="module")
    result = compare_dumps(tmp_path / "a", tmp_path / "fault")
    assert result.first_divergence.name == "blocks.1/Module.Block#0"
    assert result.culprits[0].name == "blocks.1/Module.Block#0"
