"""User errors end in one clear line (UserError), and a dump that cannot be written leaves the
training untouched: hooks removed, the next steps bit-identical to a run that never dumped."""

from __future__ import annotations

import subprocess
import sys

import h5py
import pytest
import torch
from conftest import REPO

from pi0align import Dumper
from pi0align.errors import UserError
from pi0align.testing.dump_helpers import Net

torch.set_num_threads(1)


def test_unwritable_path_is_one_clear_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    dumper = Dumper(blocker / "dump", steps=[0])
    with pytest.raises(UserError) as error:
        dumper.start(torch.nn.Linear(2, 2))
    message = str(error.value)
    assert "cannot write the dump file" in message and str(blocker) in message and "\n" not in message
    assert not torch._C._is_torch_function_mode_enabled()


@pytest.mark.parametrize(("kwargs", "fragment"), [
    ({"level": "L1"}, "dump level must be one of api, module, mix"),
    ({"mode": "md5"}, "dump mode must be one of stats, sample, tensor"),
    ({"sample_size": 0}, "sample size"),
])
def test_bad_options_are_one_clear_error(tmp_path, kwargs, fragment):
    with pytest.raises(UserError, match=fragment):
        Dumper(tmp_path, **kwargs)


FULL_DISK = """
import os, resource, signal, sys
from pathlib import Path
import torch
from pi0align.testing.dump_helpers import Net, train_steps
from pi0align import Dumper
from pi0align.errors import UserError

torch.set_num_threads(1)
torch.manual_seed(0)
inputs = [torch.randn(64, 4) for _ in range(3)]
torch.manual_seed(1)
reference = train_steps(Net(), inputs)

torch.manual_seed(1)
net = Net()
optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
dumper = Dumper(sys.argv[1], steps=[0], level="mix", mode=sys.argv[2])
dumper.start(net)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG: a full disk
children = [int(pid) for task in Path("/proc/self/task").iterdir() for pid in (task / "children").read_text().split()]
for pid in [os.getpid(), *children]:  # the writer process too
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (4096, 4096))
results = []


def report(error):
    print("error:", error)
    assert not torch._C._is_torch_function_mode_enabled()
    assert all("forward" not in m.__dict__ for m in net.modules())


for step, x in enumerate(inputs):
    loss = net(x).square().mean()
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()
    results.append((loss.item(), grad_norm.item()))
    try:
        dumper.step()
    except UserError as error:
        report(error)
try:
    dumper.close()  # the failure surfaces at the step after it, or here
except UserError as error:
    report(error)
assert results == reference, (results, reference)
print("training unchanged", flush=True)
"""


@pytest.mark.parametrize("mode", ["stats", "tensor"])
def test_a_full_disk_is_one_clear_error_and_training_goes_on_unchanged(tmp_path, mode):
    result = subprocess.run([sys.executable, "-c", FULL_DISK, str(tmp_path), mode], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[-1] == "training unchanged"
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and "cannot write the dump file" in errors[0] and "too large" in errors[0].lower()


def test_importing_pi0align_does_not_import_torch():
    code = "import sys, pi0align; pi0align.__version__; assert 'torch' not in sys.modules; " \
           "from pi0align import Dumper; assert 'torch' in sys.modules and Dumper.__name__ == 'Dumper'"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)


def test_a_tensor_file_that_cannot_be_written_is_one_clear_error(tmp_path):
    # The writer process cannot create the step's tensor folder: a file is in the way.
    (tmp_path / "dump.h5.tensors").write_text("in the way")
    torch.manual_seed(0)
    net, x = Net(), torch.randn(8, 4)
    with pytest.raises(UserError, match=r"cannot write the dump file .*dump\.h5: .*dump\.h5\.tensors"):
        with Dumper(tmp_path, steps=[0, 1], level="api", mode="tensor") as dumper:
            dumper.start(net)
            for _ in range(2):
                net(x).sum().backward()
                dumper.step()
    assert not torch._C._is_torch_function_mode_enabled()
    with h5py.File(tmp_path / "dump.h5", "r") as f:  # the statistics of step 0 were written
        assert f["steps/000000"].attrs["complete"]
