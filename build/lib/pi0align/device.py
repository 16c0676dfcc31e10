"""One place for cpu / cuda / npu: availability, RNG, determinism, synchronisation, identity.

Everything device-specific that the other parts need goes through here, so that `train` and
`dump` never branch on the device type themselves.
"""

from __future__ import annotations

import importlib
import os
import platform
from dataclasses import dataclass

import torch

from pi0align.errors import UserError

DEVICE_TYPES = ("cpu", "cuda", "npu")


@dataclass(frozen=True)
class Device:
    """A resolved, available device."""

    type: str  # "cpu" | "cuda" | "npu"
    index: int | None = None

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.type if self.index is None else f"{self.type}:{self.index}")

    @property
    def module(self):
        """The torch submodule for this device (`torch.cuda`, `torch.npu`), None for cpu."""
        return None if self.type == "cpu" else getattr(torch, self.type)

    def name(self) -> str:
        return _cpu_model() if self.type == "cpu" else self.module.get_device_name(self.index or 0)

    def count(self) -> int:
        if self.type == "cpu":
            return os.cpu_count() or 1
        return self.module.device_count()

    def synchronize(self) -> None:
        if self.module is not None:
            self.module.synchronize()

    def manual_seed_all(self, seed: int) -> None:
        if self.module is not None:
            self.module.manual_seed_all(seed)

    def rng_state(self) -> torch.Tensor | None:
        return None if self.module is None else self.module.get_rng_state()

    def set_rng_state(self, state: torch.Tensor | None) -> None:
        if self.module is not None and state is not None:
            self.module.set_rng_state(state)

    @property
    def distributed_backend(self) -> str:
        return {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}[self.type]

    def max_memory_allocated(self) -> int | None:
        return None if self.module is None else int(self.module.max_memory_allocated())


def _cpu_model() -> str:
    """The processor's model name (Linux), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host_cpu() -> dict[str, str | None]:
    """What decides how this host's CPU computes, whatever the device trains: PI0's noise is drawn
    there (policy.py) and the batch made. Its architecture (an NPU host is arm64, a GPU host x86_64)
    and model, the code path torch's CPU kernels take (the vector instructions it found, or the one
    ATEN_CPU_CAPABILITY forces: the same draw rounds otherwise in a vector and a scalar kernel),
    and the BLAS and oneDNN torch was built with; None where torch does not say."""
    import re

    config = torch.__config__.show()

    def found(pattern: str) -> str | None:
        match = re.search(pattern, config)
        return match.group(1) if match else None

    return {
        "architecture": platform.machine(),
        "model": _cpu_model(),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "capability_forced": os.environ.get("ATEN_CPU_CAPABILITY"),
        "blas": found(r"BLAS_INFO=(\w+)"),
        "mkl": found(r"Math Kernel Library Version ([\w.]+)"),
        "onednn": found(r"(?:MKL-DNN|oneDNN) v([\w.]+)"),
    }


def import_torch_npu():
    """Import torch_npu (which registers the `npu` device with torch), or say it is missing."""
    try:
        return importlib.import_module("torch_npu")
    except ImportError:
        raise UserError("--device npu needs torch_npu (Ascend's PyTorch adapter), which is not installed") from None


def resolve(spec: str) -> Device:
    """Turn `cpu`, `cuda`, `cuda:1`, `npu`, `npu:0` into an available Device, or fail in one line."""
    kind, _, index_text = spec.partition(":")
    if kind not in DEVICE_TYPES:
        raise UserError(f"unknown device {spec!r}: choose one of {', '.join(DEVICE_TYPES)}")
    if index_text and not index_text.isdigit():
        raise UserError(f"bad device index in {spec!r}: expected e.g. {kind}:0")
    index = int(index_text) if index_text else None
    if kind == "npu":
        import_torch_npu()
    if kind != "cpu":
        module = getattr(torch, kind, None)
        if module is None or not module.is_available():
            raise UserError(f"--device {spec}: no {kind} device is available on this machine")
        if index is not None and index >= module.device_count():
            raise UserError(f"--device {spec}: only {module.device_count()} {kind} device(s) present")
    return Device(kind, index)


def optional_version(distribution: str) -> str | None:
    """Installed version of a distribution, None when absent."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def cann_version() -> str | None:
    """The CANN toolkit version on an Ascend machine, None elsewhere."""
    try:
        import torch_npu  # noqa: F401

        return str(torch_npu.version.cann)  # type: ignore[attr-defined]
    except (ImportError, AttributeError):
        return os.environ.get("ASCEND_TOOLKIT_VERSION")
