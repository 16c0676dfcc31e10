"""Statistics-only dumps, ours and msprobe's, judged without a noise reference or replay (the
intrinsic rule; docs/compare.md, "Bounds"): conditions per API read from the statistics, a
softmax's mean held to rounding, culprits ordered by where the error starts, the batch found in
dumps that do not record it; and the real thing: PI0 small dumped by msprobe's PrecisionDebugger
and by pi0align, 1 against 2 threads in bf16, with and without a faulty gelu."""

from __future__ import annotations

import contextlib
import importlib.util
import subprocess
import sys

import numpy as np
import pytest
import torch

from pi0align.compare import compare_dumps
from pi0align.compare.judging.calltable.bounds import (
    CallRecords,
    conditions,
    extremes_conditions,
    invariant_errors,
    result_conditions,
)
from pi0align.compare.judging.culprits import culprit_order
from pi0align.compare.judging.judge import Judgement
from pi0align.compare.table import Table
from pi0align.dump.capturing.perturb import UlpMover
from pi0align.testing.devices import Fault, UlpNoise

# -- conditions, from hand-built records ---------------------------------------------------------


def _records(*calls: tuple[str, list[tuple]]) -> tuple[Table, Table, np.ndarray]:
    """Calls (api, records) of forward API calls, each record (role, arg_index, norm, min, max,
    mean, shape); side A's statistics, as call_table hands them to bounds.py (no tensor compared:
    the tensor metrics are NaN)."""
    rows = [(i, *record) for i, (_, records) in enumerate(calls) for record in records]
    call_of, role, arg, norm, low, high, mean, shape = (list(column) for column in zip(*rows))
    table = Table({"rank": np.zeros(len(calls), np.int64), "step": np.zeros(len(calls), np.int64),
                   "name": np.array([f"call{i}" for i in range(len(calls))], object),
                   "api": np.array([api for api, _ in calls], object),
                   "direction": np.full(len(calls), "forward", object)})
    records = Table({"role": np.array(role, object), "arg_index": np.array(arg, np.int64),
                     "direction": np.full(len(rows), "forward", object), "norm_a": np.array(norm, float),
                     "min_a": np.array(low, float), "max_a": np.array(high, float), "mean_a": np.array(mean, float),
                     "shape_a": np.array(shape, object), "mean_val_rel_err": np.zeros(len(rows)),
                     "rel_l2_err": np.full(len(rows), np.nan), "max_row_rel_l2_err": np.full(len(rows), np.nan)})
    return table, records, np.array(call_of, np.int64)


def test_each_api_is_conditioned_by_what_its_statistics_say():
    """Products add their factors' errors; a quotient or a root grows an error by how close its
    input comes to zero; a softmax by its logits' scale; a normalisation by RMS over std; a mean by
    how its terms cancel; a sum or difference by its cancellation; exp by its input's scale."""
    x = ("input", 0, 1.0, -1.0, 1.0, 0.0, "[4, 8]")
    out = ("output", 0, 1.0, -1.0, 1.0, 0.0, "[4, 8]")
    calls, records, of = _records(
        ("Tensor.mul", [x, ("input", 1, 2.0, 0.5, 1.0, 0.7, "[4, 8]"), out]),
        ("Tensor.mul", [x, out]),  # times a number
        ("Torch.rsqrt", [("input", 0, 1.0, 1e-3, 1.0, 0.5, "[4, 1]"), out]),
        ("Torch.rsqrt", [x, out]),  # its input reaches zero
        ("Tensor.__truediv__", [x, ("input", 1, 1.0, 0.1, 1.0, 0.5, "[4, 8]"), out]),
        ("Tensor.__truediv__", [x, out]),  # by a number
        ("Functional.softmax", [("input", 0, 50.0, -30.0, 20.0, 0.0, "[4, 8]"), out]),
        ("Functional.layer_norm", [("input", 0, np.sqrt(100 * 10.0), 0.0, 6.0, 3.0, "[10, 10]"), out]),
        ("Tensor.mean", [("input", 0, 4.0, -1.0, 1.0, 0.0, "[16, 8]"), ("output", 0, 0.5, -1.0, 1.0, 0.0, "[8]")]),
        ("Tensor.__add__", [x, ("input", 1, 1.0, -1.0, 1.0, 0.0, "[4, 8]"), ("output", 0, 0.01, -1, 1, 0, "[4, 8]")]),
        ("Torch.exp", [("input", 0, 5.0, -5.0, 2.0, 0.0, "[4, 8]"), out]),
        ("Functional.gelu", [x, out]),
        ("Functional.rms_norm", [x, out]),  # divides by the RMS, which moves with its input's error
    )
    condition, rule = conditions(CallRecords(calls, records, of))
    expected = [(2.0, "product"), (1.0, ""), (500.0, "quotient"), (np.inf, "quotient"), (11.0, "quotient"), (1.0, ""),
                (60.0, "softmax"), (np.sqrt(10.0), "normalization"), (2.0, "reduction"), (200.0, "cancellation"),
                (5.0, "exponential"), (1.0, ""), (1.0, "")]
    assert list(rule) == [r for _, r in expected]
    assert condition == pytest.approx([c for c, _ in expected])


def test_a_batch_of_products_is_conditioned_per_product():
    """PI0 tiny's eager attention scores, q (8, 8, 59, 8) times kᵀ, as its statistics say: the
    norms of the whole batch are √64 times one product's scale, and nothing cancels, C = 1 (it was
    8, and the scores 5 % off hid under it); a broadcast operand holds fewer products (√8 here); a
    weight shared by the batch (a linear's) none. The extremes keep the whole batch's C (an average
    shrinks its result's largest magnitude)."""
    q, k = ("input", 0, 26.2, -3.0, 3.0, 0.0, "[8, 8, 59, 8]"), ("input", 1, 26.4, -3.0, 3.0, 0.0, "[8, 8, 8, 59]")
    scores = ("output", 0, 26.2 * 26.4 / (8 * np.sqrt(8)), -9.0, 9.0, 0.0, "[8, 8, 59, 59]")
    x, weight = ("input", 0, 16.0, -3.0, 3.0, 0.0, "[4, 16, 48]"), ("input", 1, 4.0, -1.0, 1.0, 0.0, "[8, 48]")
    calls, records, of = _records(("Torch.matmul", [q, k, scores]),
                                  ("Torch.matmul", [q, ("input", 1, 26.4, -3.0, 3.0, 0.0, "[1, 8, 8, 59]"), scores]),
                                  ("Functional.linear", [x, weight, ("output", 0, 16.0 * 4.0 / 48.0, -1, 1, 0,
                                                                     "[4, 16, 8]")]))
    condition, rule = conditions(CallRecords(calls, records, of))
    assert list(rule) == ["", "matmul", "matmul"]
    assert condition == pytest.approx([1.0, np.sqrt(8.0), np.sqrt(48.0)])
    assert extremes_conditions(CallRecords(calls, records, of)) == pytest.approx([8.0, 8.0, np.sqrt(48.0)])


def test_a_product_by_a_per_row_scale_is_bounded_by_its_factors_worst_rows():
    """x * s with s constant along x's rows (RMSNorm's x * rsqrt(mean(x²) + eps)): every row of the
    product is a row of x scaled by one number, so the rows' own errors bound it, C = (ρ_x + ρ_s) /
    e_in, whatever the scales; taken only where both factors' rows were measured (full tensors)
    and one is a per-row scale."""
    x, out = ("input", 0, 1.0, -1.0, 1.0, 0.0, "[4, 8]"), ("output", 0, 1.0, -1.0, 1.0, 0.0, "[4, 8]")
    calls, records, of = _records(("Tensor.mul", [x, ("input", 1, 2.0, 0.5, 9.0, 3.0, "[4, 1]"), out]),
                                  ("Torch.mul", [x, ("input", 1, 2.0, 0.5, 9.0, 3.0, "[]"), out]),
                                  ("Tensor.mul", [x, ("input", 1, 2.0, 0.5, 1.0, 0.7, "[4, 8]"), out]),
                                  ("Tensor.mul", [x, ("input", 1, 2.0, 0.5, 9.0, 3.0, "[4, 1]"), out]),
                                  ("Tensor.add", [x, ("input", 1, 2.0, 0.5, 9.0, 3.0, "[4, 1]"), out]))
    measured = [True] * 9 + [False] * 3 + [True] * 3  # the fourth call: statistics only
    records["rel_l2_err"] = np.where(measured, np.tile([1e-4, 1e-5, 0.0], 5), np.nan)
    records["max_row_rel_l2_err"] = np.where(measured, np.tile([6e-3, 2e-3, 0.0], 5), np.nan)
    condition, rule = conditions(CallRecords(calls, records, of))
    assert list(rule) == ["row-scaled product", "row-scaled product", "product", "product", "cancellation"]
    assert condition[:4] == pytest.approx([80.0, 80.0, 2.0, 2.0])


def test_the_gradient_of_a_root_is_conditioned_by_how_close_its_forward_input_comes_to_zero():
    """rsqrt's gradient g ⊙ (-x^-1.5 / 2) is a product whose factor errs by 1.5 e R where its
    input is closest to zero (RMSNorm's variances): C = 1 + 1.5 R, from the forward call's input;
    without that forward call, 1."""
    variances = ("input", 0, 1.0, 1e-2, 1.0, 0.5, "[4, 1]")
    gradient = [("grad_output", 0, 1.0, -1.0, 1.0, 0.0, "[4, 1]"), ("grad_input", 0, 1.0, -1.0, 1.0, 0.0, "[4, 1]")]
    calls, records, of = _records(("Torch.rsqrt", [variances, ("output", 0, 1.0, 1.0, 10.0, 5.0, "[4, 1]")]),
                                  ("Torch.rsqrt", gradient), ("Torch.rsqrt", gradient))
    calls["direction"] = np.array(["forward", "backward", "backward"], object)
    calls["name"] = np.array(["root", "root", "elsewhere"], object)  # the last one's forward was not recorded
    records["direction"] = np.array(["forward"] * 2 + ["backward"] * 4, object)
    condition, rule = conditions(CallRecords(calls, records, of))
    assert list(rule) == ["quotient", "quotient gradient", ""]
    assert condition == pytest.approx([50.0, 1.0 + 1.5 * 100.0, 1.0])


def test_a_softmax_keeps_its_mean_whatever_its_input():
    """Every row of a softmax sums to one: the error of its output's mean is rounding alone,
    whatever its input holds, so a softmax scaled by 1.01 cannot hide behind its condition."""
    calls, records, of = _records(("Functional.softmax", [("input", 0, 50.0, -30.0, 20.0, 0.0, "[4, 8]"),
                                                          ("output", 0, 1.0, 0.0, 1.0, 0.125, "[4, 8]")]),
                                  ("Functional.gelu", [("input", 0, 1.0, -1.0, 1.0, 0.0, "[4, 8]"),
                                                       ("output", 0, 1.0, -1.0, 1.0, 0.0, "[4, 8]")]))
    records["mean_val_rel_err"] = np.array([0.0, 1e-2, 0.0, 1e-2])
    assert list(invariant_errors(CallRecords(calls, records, of))) == [1e-2, 0.0]


def test_culprits_are_ranked_where_the_error_starts_unless_a_later_one_is_clearly_worse():
    """In one step: a backward culprit 30× beyond its bound ranks above a forward one 2.6× beyond,
    one 5× beyond does not; the earlier step leads whatever its blame."""
    calls = Table({"step": np.array([0, 0, 0, 1]), "direction": np.array(["forward", "backward", "backward",
                                                                          "forward"], object),
                   "seq_a": np.array([3, 7, 9, 1])})
    judgement = Judgement(culprit=np.ones(4, bool), evidence=np.full(4, "intrinsic", object),
                          wrong_side=np.full(4, "", object), blame=np.array([2.6, 5.0, 30.0, 900.0]),
                          within=np.full(4, "", object), enclosing=np.full(4, -1))
    assert list(culprit_order(calls, judgement)) == [2, 0, 1, 3]


# -- end to end: rms_norm in bf16 under ulp noise ---------------------------------------------------


def _dump_one_step(path, make_model, batch: torch.Tensor, mode: str, *emulations) -> None:
    """One training step of `make_model()` (seeded) on `batch`, dumped at level mix in `mode`, on a
    device emulated by `emulations` (each made from the model), if any."""
    from pi0align.dump import Dumper

    torch.manual_seed(0)
    model = make_model()
    manifest = {"device_name": "emulated"} if emulations else None
    with contextlib.ExitStack() as emulated, Dumper(path, mode=mode, level="mix", manifest=manifest) as dumper:
        for make in emulations:
            emulated.enter_context(make(model))
        dumper.start(model)
        model(batch).float().square().mean().backward()
        dumper.step()


class _RmsBlock(torch.nn.Module):
    """Linear → F.rms_norm with a weight of its own → Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.nn.functional.rms_norm(self.a(x), (64,), self.weight))


class _RmsBlocks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_RmsBlock() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def test_an_rms_norm_under_noise_is_aligned_and_one_3_percent_off_the_culprit(tmp_path):
    """F.rms_norm divides by its input's RMS, which an error moves with it (C = 1, docs/compare.md):
    bf16 ulp noise is aligned from statistics; one rms_norm × 1.03 (4 ulps of bf16) is the culprit."""
    x = torch.randn(8, 16, 64, generator=torch.Generator().manual_seed(1)).bfloat16()

    def dump(path, *emulations) -> None:
        _dump_one_step(path, lambda: _RmsBlocks().bfloat16(), x, "stats", *emulations)

    noise = lambda model: UlpNoise(1, seed=4)  # noqa: E731
    dump(tmp_path / "a")
    dump(tmp_path / "noise", noise)
    dump(tmp_path / "fault", noise, lambda model: Fault(model.blocks[2], torch.nn.functional.rms_norm, 0, 1.03))
    quiet = compare_dumps(tmp_path / "a", tmp_path / "noise", replay=False)
    assert (quiet.verdict, quiet.culprits) == ("aligned", []), [(c.name, c.direction) for c in quiet.culprits]
    faulty = compare_dumps(tmp_path / "a", tmp_path / "fault", replay=False)
    assert faulty.verdict == "diverged" and faulty.culprits[0].api == "Functional.rms_norm"
    assert faulty.culprits[0].module == "blocks.2" and faulty.culprits[0].direction == "forward"


class _GemmaRmsNorm(torch.nn.Module):
    """transformers' Gemma RMSNorm: in float32, x * rsqrt(mean(x²) + eps), then × (1 + weight)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(0.1 * torch.randn(64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.float()
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (normed * (1.0 + self.weight.float())).type_as(x)


class _PaddedLayers(torch.nn.Module):
    """Linear → Gemma RMSNorm → Linear, twice, on tokens some of which are padding (zero) and
    some nearly so: the norm scales each row to the same RMS, so its product grows the relative
    error of the rows of small norm far beyond their share of the whole."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.ModuleList(torch.nn.Linear(64, 64, bias=False) for _ in range(2))
        self.norm = torch.nn.ModuleList(_GemmaRmsNorm() for _ in range(2))
        self.b = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for a, norm, b in zip(self.a, self.norm, self.b):
            x = x + b(norm(a(x)))
        return x


class _RowNoise(torch.overrides.TorchFunctionMode):
    """The first linear inside `module`'s forward with the results of some tokens (rows 8 to 11)
    moved by an ulp: another accumulation order for those rows alone, as another thread count's
    blocking gives."""

    def __init__(self, module: torch.nn.Module, seed: int) -> None:
        super().__init__()
        self.module, self.mover, self.running = module, UlpMover(1, seed), False
        self.module.register_forward_pre_hook(lambda *_: setattr(self, "running", True))
        self.module.register_forward_hook(lambda *_: setattr(self, "running", False))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if self.running and func is torch.nn.functional.linear:
            with torch._C.DisableTorchFunction():
                moved = result.detach().clone()
                moved[:, 8:12] = self.mover.move(moved[:, 8:12])
                return result + (moved - result).detach()
        return result


@pytest.mark.parametrize("noisy", ["a.0", "a.1"])
def test_products_by_per_row_scales_under_noise_are_aligned_and_one_3_percent_off_the_culprit(noisy, tmp_path):
    """Full tensors without replay: tokens of small norm an ulp off, through a Gemma RMSNorm that
    scales every token to the same RMS, are aligned (its x * rsqrt(...) is bounded by its
    factors' worst rows, the gradient of its square is a product: docs/compare.md, Bounds; before,
    that product or that gradient was named); the second layer's product × 1.03, or the gradient
    of its square, is the culprit."""
    x = torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(1))
    x[:, 12:] = 0.0  # padding
    x[:, 8:12] *= 1e-2  # tokens of small norm

    def dump(path, *emulations) -> None:
        _dump_one_step(path, lambda: _PaddedLayers().bfloat16(), x.bfloat16(), "tensor", *emulations)

    noise = lambda model: _RowNoise(model.get_submodule(noisy), seed=4)  # noqa: E731
    dump(tmp_path / "a")
    dump(tmp_path / "noise", noise)
    quiet = compare_dumps(tmp_path / "a", tmp_path / "noise", replay=False)
    assert (quiet.verdict, quiet.culprits) == ("aligned", []), [(c.name, c.direction) for c in quiet.culprits]
    for func, backward, culprit in ((torch.Tensor.mul, False, ("norm.1/Tensor.mul#0", "forward")),
                                    (torch.Tensor.pow, True, ("norm.1/Tensor.pow#0", "backward"))):
        fault = lambda model: Fault(model.norm[1], func, 0, 1.03, backward=backward)  # noqa: B023, E731
        dump(tmp_path / func.__name__, noise, fault)
        faulty = compare_dumps(tmp_path / "a", tmp_path / func.__name__, replay=False)
        assert faulty.verdict == "diverged", faulty.verdict
        assert (faulty.culprits[0].name, faulty.culprits[0].direction) == culprit, \
            [(c.name, c.direction) for c in faulty.culprits]


# -- end to end: a softmax on bf16 logits with a large spread ----------------------------------


class _Head(torch.nn.Module):
    """Attention weights as PI0's attention makes them: bf16 logits, softmax in float32."""

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return torch.softmax(torch.matmul(q, k.transpose(-1, -2)).float(), dim=-1)


class _Heads(torch.nn.Module):
    def __init__(self, count: int = 4) -> None:
        super().__init__()
        self.heads = torch.nn.ModuleList(_Head() for _ in range(count))

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return torch.stack([head(q[:, i], k[:, i]) for i, head in enumerate(self.heads)])


def _dump_heads(path, *modes_of, backward: bool = False) -> None:
    """One step of _Heads, its loss a weighted sum of the attention weights (their plain sum has
    no gradient: every row sums to one)."""
    from pi0align.dump import Dumper

    model = _Heads()
    generator = torch.Generator().manual_seed(3)
    # batch 2, 4 heads, 16 tokens of 32: logits of std 2 × 2 × √32 ≈ 23, spread over about ±70
    q, k = (2.0 * torch.randn(2, 2, 4, 16, 32, generator=generator)).bfloat16().unbind(0)
    q.requires_grad_(backward)
    weights = torch.randn(4, 2, 16, 16, generator=generator)
    # an emulated device is another device: its runs are not bit-comparable with the CPU's
    manifest = {"device_name": "emulated"} if modes_of else None
    with contextlib.ExitStack() as emulated, Dumper(path, mode="stats", level="api", manifest=manifest) as dumper:
        for make in modes_of:  # pushed before the dumper's own mode: it records what they return
            emulated.enter_context(make(model))
        dumper.start(model)
        loss = (model(q, k) * weights).sum()
        if backward:
            loss.backward()
        dumper.step()


def test_a_softmax_of_noisy_logits_is_noise_and_its_scaled_output_a_culprit(tmp_path):
    """bf16 logits moved by an ulp (up to ±0.25 on logits of ±60) move a softmax's outputs by tens
    of percent: within its condition (2 max|z| × its input's error), so within noise. The same
    softmax with its output × 1.01 is the culprit: its mean is held to rounding."""
    noise = lambda model: UlpNoise(1, seed=4)  # noqa: E731
    _dump_heads(tmp_path / "a")
    _dump_heads(tmp_path / "noise", noise)
    _dump_heads(tmp_path / "fault", noise, lambda model: Fault(model.heads[1], torch.softmax, 0, 1.01))
    quiet = compare_dumps(tmp_path / "a", tmp_path / "noise", replay=False)
    assert (quiet.verdict, quiet.culprits, quiet.noise_model) == ("aligned", [], "intrinsic")
    assert quiet.rows_over_dtype_limits > 0  # the noise is there, beyond the fixed limits
    faulty = compare_dumps(tmp_path / "a", tmp_path / "fault", replay=False)
    assert faulty.verdict == "diverged" and faulty.culprits[0].name == "heads.1/Torch.softmax#0"
    assert "keeps whatever its inputs" in faulty.culprits[0].bound_by


def test_a_softmax_gradient_of_noisy_logits_is_noise_and_its_scaled_gradient_a_culprit(tmp_path):
    """A softmax's gradient p ⊙ (g − Σ p g) cancels: on logits of large spread (p nearly one-hot)
    ulp noise moves it by up to 8 % while its incoming gradient holds the same bits, within its
    condition 2 max p ‖g‖ / ‖dz‖ (here about 58; before, C = 1: every head's gradient was named).
    The same gradient × 2.5 is the culprit, about 3 times its bound (× 2 is 2.2 times it)."""
    noise = lambda model: UlpNoise(1, seed=4)  # noqa: E731
    _dump_heads(tmp_path / "a", backward=True)
    _dump_heads(tmp_path / "noise", noise, backward=True)
    _dump_heads(tmp_path / "fault", noise, lambda model: Fault(model.heads[1], torch.softmax, 0, 2.5, backward=True),
                backward=True)
    quiet = compare_dumps(tmp_path / "a", tmp_path / "noise", replay=False)
    assert (quiet.verdict, quiet.culprits) == ("aligned", []), [(c.name, c.direction) for c in quiet.culprits]
    faulty = compare_dumps(tmp_path / "a", tmp_path / "fault", replay=False)
    top = faulty.culprits[0]
    assert (faulty.verdict, top.name, top.direction) == ("diverged", "heads.1/Torch.softmax#0", "backward")
    assert "softmax gradient" in top.bound_by


# -- the real thing: PI0 small in bf16, dumped by msprobe and by pi0align ------------------------

msprobe = pytest.mark.skipif(importlib.util.find_spec("msprobe") is None, reason="mindstudio-probe not installed")
# the 5th gelu of step 0's forward (language model layer 0's MLP) 2 % off: 5 unit roundoffs of bf16
GELU = 'Emulation(fault=("", "gelu", 4, 1.02), fault_forwards=1)'
GELU_CALL = "language_model.layers.0.mlp.act_fn/Functional.gelu#0"


def _child(code: str) -> None:
    """Run in a child process: msprobe patches torch for good."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def pi0_dumps(tmp_path_factory):
    """PI0 small, one bf16 step: the benchmark at 1 thread, the run under test at 2 threads, and
    at 2 threads with the gelu fault; by msprobe (statistics, L1 and mix) and by pi0align (stats,
    level mix, no noise reference)."""
    root = tmp_path_factory.mktemp("pi0-statistics")
    runs = {"a": (1, "Emulation()"), "b": (2, "Emulation()"), "c": (2, GELU)}
    made = {}
    for name, (threads, device) in runs.items():
        for level in ("L1", "mix"):
            out = root / f"msprobe-{level}-{name}"
            _child("from pi0align.testing.scenarios import Emulation, dump_pi0_with_msprobe; "
                   f"dump_pi0_with_msprobe({str(out)!r}, level={level!r}, threads={threads}, device={device})")
            made[f"msprobe-{level}", name] = out / "msprobe"
        out = root / f"pi0align-{name}"
        _child("from pi0align.testing.scenarios import Emulation, Pi0Run, dump_pi0; "
               f"dump_pi0({str(out)!r}, Pi0Run(mode='stats', threads={threads}, steps=1, device={device}))")
        made["pi0align", name] = out
    return made


@msprobe
@pytest.mark.slow  # nine PI0 small runs, each a process importing torch and LeRobot
@pytest.mark.parametrize("dumped_by", ["msprobe-L1", "msprobe-mix", "pi0align"])
def test_pi0_statistics_noise_is_aligned_and_a_gelu_2_percent_off_is_the_culprit(dumped_by, pi0_dumps):
    """1 against 2 threads: aligned within noise, no culprit (msprobe's own compare passes every
    row). With the gelu 2 % off: that gelu is the top culprit, no softmax above it (before: the
    optimizer's arithmetic was named under noise, softmax calls 16,000-69,000× above the gelu)."""
    noise = compare_dumps(pi0_dumps[dumped_by, "a"], pi0_dumps[dumped_by, "b"], replay=False)
    assert (noise.verdict, noise.culprits) == ("aligned", []), noise.notes[-2:]
    assert noise.within_noise
    fault = compare_dumps(pi0_dumps[dumped_by, "a"], pi0_dumps[dumped_by, "c"], replay=False)
    assert fault.verdict == "diverged"
    top = fault.culprits[0]
    assert top.api == "Functional.gelu" and top.step == 0, [(c.name, c.introduced_error) for c in fault.culprits]
    if dumped_by != "msprobe-L1":  # msprobe writes module scopes at level mix only
        assert top.name.endswith(GELU_CALL)
    assert "rounding" in top.bound_by and top.introduced_error > 2


@msprobe
@pytest.mark.slow  # four toy runs under msprobe, each a process
@pytest.mark.parametrize("level", ["L1", "mix"])
def test_a_changed_batch_in_msprobe_statistics_dumps_is_the_data(level, tmp_path):
    """msprobe records no batch and no checksums: one sample of step 1's batch 1 % off comes out
    as kind `data` at step 1, the model's input as its first call read it (before: a matmul deep
    in the model was the first divergence)."""
    dumps = {}
    for name, changed in (("a", ""), ("b", ", changed_sample_at=1, sample_change=1e-2")):
        out = tmp_path / name
        _child("from pi0align.testing.scenarios import ToyRun, dump_toy_with_msprobe; "
               f"dump_toy_with_msprobe({str(out)!r}, ToyRun(model='transformer'{changed}), level={level!r})")
        dumps[name] = out
    result = compare_dumps(dumps["a"], dumps["b"], replay=False)
    first = result.first_divergence
    assert result.verdict == "diverged" and (first.kind, first.step) == ("data", 1), (first, result.notes[-2:])
    assert all(c.step == 1 for c in result.culprits)


def test_a_module_linear_is_conditioned_by_its_weight_from_the_parameter_records():
    """A `Module.Linear` (level module, msprobe's L0) records its input and output, not its weight:
    the weight's Parameter record of the same step stands for it. Forward C = ‖x‖ ‖W‖ / (√K ‖y‖)
    (K = 32 input features), its input gradient's C = ‖G‖ ‖W‖ / (√K ‖dX‖) (K = 96 output features).
    Before: both unknown, the call's C (1) for its input gradient. Without the Parameter record:
    unknown, as before."""
    w = ("parameter", 0, 5.623, -1.0, 1.0, 0.0, "[96, 32]")
    x, y = ("input", 0, 39.19, -3.0, 3.0, 0.0, "[4, 12, 32]"), ("output", 0, 4.0, -1.0, 1.0, 0.0, "[4, 12, 96]")
    g, dx = ("grad_output", 0, 0.01153, -1e-3, 1e-3, 0.0, "[4, 12, 96]"), ("grad_input", 0, 0.002, -1e-3, 1e-3, 0.0,
                                                                                "[4, 12, 32]")
    for with_weight in (True, False):
        calls, records, of = _records(("Parameter", [w]), ("Module.Linear", [x, y]), ("Module.Linear", [g, dx]))
        calls["direction"] = np.array(["parameter", "forward", "backward"], object)
        calls["name"] = np.array(["qkv.weight/Parameter#0" if with_weight else "other.weight/Parameter#0",
                                  "qkv/Module.Linear#0", "qkv/Module.Linear#0"], object)
        calls["module"] = np.array(["qkv" if with_weight else "other", "qkv", "qkv"], object)
        records["direction"] = np.array(["parameter", "forward", "forward", "backward", "backward"], object)
        condition, rule = conditions(CallRecords(calls, records, of))
        per_result, _ = result_conditions(CallRecords(calls, records, of))
        if with_weight:
            assert condition[1] == pytest.approx(39.19 * 5.623 / (np.sqrt(32) * 4.0)) and rule[1] == "matmul"
            assert per_result[4] == pytest.approx(0.01153 * 5.623 / (np.sqrt(96) * 0.002))  # 3.3
        else:
            assert condition[1] == 1.0 and rule[1] == "" and np.isnan(per_result[4])


def test_each_result_of_a_linears_backward_is_conditioned_on_its_own():
    """The toy transformer's first qkv linear at step 0, as its statistics say (its operands'
    gradients made smaller, as where they cancel): dX = G W sums over the 96 output features,
    dW = Gᵀ X over the 48 positions, C = ‖G‖ ‖O‖ / (√K ‖R‖) each, from the forward call's
    operands; the bias gradient sums G over the positions, reduction_condition. Without its
    forward call, the operand gradients keep the call's C (NaN)."""
    x, w = ("input", 0, 39.19, -3.0, 3.0, 0.0, "[4, 12, 32]"), ("input", 1, 5.623, -1.0, 1.0, 0.0, "[96, 32]")
    forward = [x, w, ("input", 2, 1.02, -1.0, 1.0, 0.0, "[96]"), ("output", 0, 40.15, -9.0, 9.0, 0.0, "[4, 12, 96]")]
    g = ("grad_output", 0, 0.01153, -1e-3, 1e-3, 0.0, "[4, 12, 96]")
    dx, dw = ("grad_input", 0, 0.002, -1e-3, 1e-3, 0.0, "[4, 12, 32]"), ("grad_input", 1, 0.02, -1, 1, 0, "[96, 32]")
    backward = [g, dx, dw, ("grad_input", 2, 0.05898, -1e-2, 1e-2, 0.0, "[96]")]
    calls, records, of = _records(("Functional.linear", forward), ("Functional.linear", backward),
                                  ("Functional.linear", backward))
    calls["direction"] = np.array(["forward", "backward", "backward"], object)
    calls["name"] = np.array(["qkv", "qkv", "elsewhere"], object)  # the last one's forward was not recorded
    records["direction"] = np.array(["forward"] * 4 + ["backward"] * 8, object)
    condition, extremes = result_conditions(CallRecords(calls, records, of))
    per_result = [0.01153 * 5.623 / (np.sqrt(96) * 0.002), 0.01153 * 39.19 / (np.sqrt(48) * 0.02),
                  np.sqrt(4 * 12) * 0.01153 / 0.05898]  # 3.3, 3.3 (their gradients cancel), 1.35
    assert np.isnan(condition[:5]).all() and condition[5:8] == pytest.approx(per_result)
    assert extremes[5:7] == pytest.approx(per_result[:2]) and np.isnan(extremes[7])
    assert np.isnan(condition[9:11]).all() and condition[11] == pytest.approx(per_result[2])
    # a batch of products both operands hold: C per product, the extremes' over the batch
    q, k = ("input", 0, 26.2, -3.0, 3.0, 0.0, "[8, 8, 59, 8]"), ("input", 1, 26.4, -3.0, 3.0, 0.0, "[8, 8, 8, 59]")
    scores = ("output", 0, 100.0, -9.0, 9.0, 0.0, "[8, 8, 59, 59]")
    gradients = [("grad_output", 0, 10.0, -1.0, 1.0, 0.0, "[8, 8, 59, 59]"),
                 ("grad_input", 0, 10.0 * 26.4 / (8 * np.sqrt(59)), -1.0, 1.0, 0.0, "[8, 8, 59, 8]")]
    calls, records, of = _records(("Torch.matmul", [q, k, scores]), ("Torch.matmul", gradients))
    calls["direction"] = np.array(["forward", "backward"], object)
    calls["name"] = np.array(["scores", "scores"], object)
    records["direction"] = np.array(["forward"] * 3 + ["backward"] * 2, object)
    condition, extremes = result_conditions(CallRecords(calls, records, of))
    assert condition[4] == pytest.approx(1.0) and extremes[4] == pytest.approx(8.0)
