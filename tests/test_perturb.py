"""A noise reference: Dumper(perturb_ulps=N) moves every floating result by at most N ulps, at
random but seeded, in every step while started, leaving the run's own random numbers alone."""

from __future__ import annotations

import h5py
import numpy as np
import torch
from conftest import assert_one_line_error, run_cli

from pi0align import Dumper
from pi0align.testing.dump_helpers import manifest, read_step
from pi0align.testing.models import Mlp


def _train(path, perturb_ulps: int, seed: int = 3, steps: int = 2) -> list[float]:
    torch.manual_seed(0)
    model = Mlp(width=16, depth=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    losses = []
    with Dumper(path, steps=[0, 1], mode="tensor", level="api", perturb_ulps=perturb_ulps, perturb_seed=seed) as dumper:
        dumper.start(model)
        for _ in range(steps):
            loss = model(x).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            dumper.step()
    losses.append(torch.rand(1).item())  # the global generator: not drawn from by the perturbation
    return losses


def _output(path, step: int, name: str) -> np.ndarray:
    tables = read_step(path / "dump.h5", step)
    calls, records = tables["calls"], tables["records"]
    call = calls["name"].index(name)
    row = next(i for i, (c, role) in enumerate(zip(records["call_id"], records["role"]))
               if c == call and role == "output")
    with h5py.File(path / "dump.h5") as f:
        return f[f"steps/{step:06d}/{records['tensor'][row]}"][()]


def test_results_move_by_at_most_n_ulps_and_the_run_keeps_its_random_numbers(tmp_path):
    torch.manual_seed(5)
    plain = _train(tmp_path / "plain", 0)
    torch.manual_seed(5)
    moved = _train(tmp_path / "moved", 2)
    torch.manual_seed(5)
    again = _train(tmp_path / "again", 2)
    assert moved == again  # seeded
    assert moved[-1] == plain[-1]  # the global generator is untouched
    assert moved[:2] != plain[:2] and abs(moved[0] - plain[0]) < 1e-5 * abs(plain[0])
    # the first call of the step sees identical inputs: its output moves by at most 2 ulps
    name = "blocks.0.0/Functional.linear#0"
    a, b = _output(tmp_path / "plain", 0, name), _output(tmp_path / "moved", 0, name)
    distance = np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32).astype(np.int64))
    assert distance.max() <= 2 and (distance > 0).mean() > 0.5
    assert manifest(tmp_path / "moved" / "dump.h5")["perturb_ulps"] == 2
    assert manifest(tmp_path / "plain" / "dump.h5")["perturb_ulps"] == 0
    assert torch.overrides._get_current_function_mode() is None  # nothing left installed after close()


def test_run_flag_needs_dump_steps():
    assert_one_line_error(run_cli("run", "--perturb-ulps", "1", "--preset", "tiny"), "--perturb-ulps", "--dump-steps")
    assert_one_line_error(run_cli("run", "--perturb-ulps", "-1", "--preset", "tiny", "--dump-steps", "0"),
                          "--perturb-ulps")
