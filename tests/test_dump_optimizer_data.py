"""The optimizer's update and the batch as records: `Optimizer.step` per parameter (parameter,
gradient after clipping and states in; updated parameter and states out; hyper-parameters as its
arguments) and `Data` per key of the model's inputs, ahead of the forward calls, after the
parameters. On the extension's recorder and on the Python path."""

from __future__ import annotations

import json

import pytest
import torch

from pi0align import Dumper
from pi0align.testing.dump_helpers import read_step, reference_checksum

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def dumped(backend, tmp_path_factory):
    """Two AdamW steps dumped on each backend; the dump file and what its last step must hold."""
    return _train(tmp_path_factory.mktemp(backend) / "dump", steps=2, backend=backend)


class Policy(torch.nn.Module):
    """A policy reading a dict batch, as LeRobot's PI0 does."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.Linear(3, 4)
        self.head = torch.nn.Linear(4, 2)

    def forward(self, batch: dict) -> torch.Tensor:
        features = self.encoder(batch["observation.state"]) * batch["mask"][:, None]
        return (self.head(features) - batch["action"]).square().mean()


def _batch(step: int) -> dict:
    generator = torch.Generator().manual_seed(step)
    return {"observation.state": torch.randn(5, 3, generator=generator), "mask": torch.ones(5),
            "action": torch.randn(5, 2, generator=generator), "episode": [step]}


def _train(path, steps: int, backend: str, clip: float = 0.5):
    """AdamW steps with clipping, every step dumped; returns what the records must hold at the
    last step: the parameters, clipped gradients and states before and after the update."""
    torch.manual_seed(0)
    policy = Policy()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2, eps=1e-7, weight_decay=0.1)
    seen = {}
    batches = [_batch(step) for step in range(steps)]  # made outside the steps, as a loader does
    with Dumper(path, level="api", backend=backend) as dumper:
        dumper.start(policy, optimizer=optimizer)
        for batch in batches:
            loss = policy(batch)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(policy.parameters(), clip)
            seen = {name: {"param": p.detach().clone(), "grad": p.grad.clone(),
                           "state": {k: v.clone() for k, v in optimizer.state.get(p, {}).items()}}
                    for name, p in policy.named_parameters()}
            optimizer.step()
            for name, p in policy.named_parameters():
                seen[name]["updated"] = p.detach().clone()
                seen[name]["updated_state"] = {k: v.clone() for k, v in optimizer.state[p].items()}
            optimizer.zero_grad()
            dumper.step()
    return dumper.file, seen


def _records_of(tables: dict, name: str) -> dict[tuple[str, int], int]:
    """(role, arg_index) -> row of the records of the call named `name`."""
    calls, records = tables["calls"], tables["records"]
    call = calls["name"].index(name)
    return {(records["role"][i], records["arg_index"][i]): i for i in range(len(records["role"]))
            if records["call_id"][i] == call}


def test_each_update_is_one_call_with_the_tensors_it_read_and_wrote(dumped):
    path, seen = dumped
    tables = read_step(path, 1)
    calls, records = tables["calls"], tables["records"]
    updates = [n for n, d in zip(calls["name"], calls["direction"]) if d == "optimizer"]
    assert updates == [f"{p}/Optimizer.step#0" for p in ("encoder.weight", "encoder.bias", "head.weight", "head.bias")]
    state_names = ["exp_avg", "exp_avg_sq", "step"]
    for parameter, held in seen.items():
        name = f"{parameter}/Optimizer.step#0"
        rows = _records_of(tables, name)
        expected = {("input", 0): held["param"], ("input", 1): held["grad"], ("output", 0): held["updated"]}
        for index, state in enumerate(state_names, start=2):
            expected[("input", index)] = held["state"][state]
            expected[("output", index)] = held["updated_state"][state]
        assert set(rows) == set(expected)
        for key, tensor in expected.items():
            assert records["checksum"][rows[key]] == reference_checksum(tensor), (name, key)
        call = calls["name"].index(name)
        assert calls["api"][call] == "Optimizer.step" and calls["module"][call] == parameter.rpartition(".")[0]
        arguments = json.loads(calls["args"][call])
        assert arguments["state"] == state_names
        settings = arguments["hyper_parameters"]
        assert (settings["lr"], settings["eps"], settings["weight_decay"], settings["betas"]) == (1e-2, 1e-7, 0.1,
                                                                                                  [0.9, 0.999])
        assert "foreach" not in settings and "fused" not in settings  # implementation switches, not settings
    # the gradient the optimizer read is the clipped one, not the one backward accumulated
    grad_row = _records_of(tables, "head.weight/Parameter#0")[("parameter_grad", 0)]
    update_row = _records_of(tables, "head.weight/Optimizer.step#0")[("input", 1)]
    assert records["norm"][update_row] < records["norm"][grad_row]


def test_the_first_update_has_no_states_in_and_its_states_out(dumped):
    tables = read_step(dumped[0], 0)
    rows = _records_of(tables, "encoder.bias/Optimizer.step#0")
    assert sorted(rows) == [("input", 0), ("input", 1), ("output", 0), ("output", 2), ("output", 3), ("output", 4)]


def test_the_batch_is_data_keyed_by_its_paths_after_the_parameters(dumped):
    tables = read_step(dumped[0], 0)
    calls, records = tables["calls"], tables["records"]
    directions = calls["direction"]
    assert directions[:4] == ["parameter"] * 4 and directions[4:7] == ["data"] * 3
    assert calls["name"][4:7] == ["observation.state/Data#0", "mask/Data#0", "action/Data#0"]
    assert directions[7] == "forward" and directions[-1] == "optimizer"
    row = _records_of(tables, "action/Data#0")[("output", 0)]
    assert records["checksum"][row] == reference_checksum(_batch(0)["action"])


def test_without_the_optimizer_nothing_of_it_is_recorded_and_its_hooks_go_with_the_dumper(tmp_path):
    torch.manual_seed(0)
    policy = Policy()
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.1)
    batch = _batch(0)
    with Dumper(tmp_path / "plain", steps=[0]) as dumper:
        dumper.start(policy)
        policy(batch).backward()
        optimizer.step()
        dumper.step()
    assert "optimizer" not in read_step(dumper.file, 0)["calls"]["direction"]
    with Dumper(tmp_path / "hooked", steps=[0]) as dumper:
        dumper.start(policy, optimizer=optimizer)
        policy(batch).backward()
        optimizer.step()
        dumper.step()
    assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks
