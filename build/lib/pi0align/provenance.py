"""Where a run came from: library versions, the initial weights' hash, the project's commit.

Shared by the training manifest and the dumper's (which also serves users' own training scripts):
`environment` is what both say of where a run ran.
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
from pathlib import Path

import torch

from pi0align.device import Device, cann_version, host_cpu, optional_version
from pi0align.version import __version__

VERSIONED_DISTRIBUTIONS = {
    "torch": "torch", "torch_npu": "torch-npu", "transformers": "transformers", "lerobot": "lerobot",
    "deepspeed": "deepspeed", "accelerate": "accelerate", "msprobe": "mindstudio-probe",
    "torchvision": "torchvision", "numpy": "numpy",
}


def environment(device: Device, rank: int, world_size: int) -> dict:
    """What both manifests (the run's and the dump's) say of where a run ran: device, process group,
    versions and numerics switches."""
    return {
        "device": device.type,
        "device_name": device.name(),
        "device_count": device.count(),
        "world_size": world_size,
        "rank": rank,
        "host": platform.node(),
        "cpu": host_cpu(),
        "versions": versions(),
        "numerics": numerics(),
    }


def versions() -> dict[str, str | None]:
    """Versions of python, pi0align, CANN and the libraries that change numerics; None when absent."""
    found = {name: optional_version(distribution) for name, distribution in VERSIONED_DISTRIBUTIONS.items()}
    return {"python": platform.python_version(), "pi0align": __version__, "cann": cann_version(), **found}


# environment variables that change numerics: cuBLAS's deterministic workspace, HCCL's
# deterministic reductions, NVIDIA's TF32 override, the CPU threads and Python's hash seed
NUMERICS_VARIABLES = ("CUBLAS_WORKSPACE_CONFIG", "HCCL_DETERMINISTIC", "NVIDIA_TF32_OVERRIDE", "OMP_NUM_THREADS",
                      "PYTHONHASHSEED")


def numerics() -> dict[str, object]:
    """The switches that change numerics: CPU threads, TF32 (NVIDIA), HF32 (Ascend), the float32
    matmul precision, deterministic algorithms, the environment variables among NUMERICS_VARIABLES
    (None where unset), and autocast per device type (its dtype, or "off"). None where the
    backend is absent."""
    npu = getattr(torch, "npu", None)
    return {
        "threads": torch.get_num_threads(),  # CPU reductions split by thread: another count, other rounding
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cuda_matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,  # PyTorch's default is True: convolutions on TF32
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "npu_matmul_allow_hf32": _flag(npu, "matmul"),
        "npu_conv_allow_hf32": _flag(npu, "conv"),
        "environment": {name: os.environ.get(name) for name in NUMERICS_VARIABLES},
        # autocast where the manifest is made (a user's loop may dump inside a region): its dtype, or "off"
        "autocast": {kind: str(torch.get_autocast_dtype(kind)).removeprefix("torch.") if _autocast_on(kind)
                     else "off" for kind in ("cpu", "cuda", "npu")},
    }


def _autocast_on(kind: str) -> bool:
    try:
        return torch.is_autocast_enabled(kind)
    except RuntimeError:  # a device type this torch does not know
        return False


def _flag(npu, kind: str) -> bool | None:
    try:
        return bool(getattr(npu, kind).allow_hf32)
    except AttributeError:
        return None


def weights_sha256(model: torch.nn.Module) -> str:
    """SHA-256 over every parameter and buffer: name, dtype, shape and raw bytes, in name order."""
    digest = hashlib.sha256()
    with torch._C.DisableTorchFunction():  # never seen by a dumper that may be capturing
        for name, tensor in sorted(model.state_dict().items()):
            digest.update(f"{name}|{tensor.dtype}|{list(tensor.shape)}".encode())
            host = tensor.detach().to("cpu").contiguous()
            digest.update(host.reshape(-1).view(torch.uint8).numpy().tobytes() if host.numel() else b"")
    return digest.hexdigest()


def git_commit() -> str | None:
    """The project's commit, with "+dirty" when tracked files have changes; None outside git."""
    source = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "-C", str(source), "rev-parse", "HEAD"], capture_output=True, text=True,
                                check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(source), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+dirty" if dirty else "")
