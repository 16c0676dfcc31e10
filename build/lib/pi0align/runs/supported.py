"""The versions pi0align supports and the switches a comparable run needs, and a machine against
them (`pi0align doctor`). SUPPORTED is the table docs/supported-versions.md shows."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version

ALL_DEVICES = ("cpu", "cuda", "npu")
OK, MISMATCH, ABSENT, NOT_NEEDED = "ok", "mismatch", "absent", "not needed"
WARNING, INFO = "warning", "info"  # a switch left to chance; what a comparison must know of this machine


@dataclass(frozen=True)
class Requirement:
    """A library: its name (as in the manifest's `versions`), the versions supported (a PEP 440
    specifier; `{torch}` stands for torch's major.minor), the devices it is needed on (none:
    optional) and what to do when it does not match."""

    name: str
    specifier: str
    needed_on: tuple[str, ...]
    hint: str


SUPPORTED = [
    Requirement("python", ">=3.10,<3.13", ALL_DEVICES, "Python 3.10 to 3.12 (tested: 3.11)"),
    Requirement("torch", "==2.14.*", ALL_DEVICES,
                "the tested pair is torch 2.14.1 with torchvision 0.29.1: bash scripts/install.sh"),
    Requirement("torchvision", "==0.29.*", ALL_DEVICES, "torchvision 0.29 goes with torch 2.14"),
    Requirement("transformers", "==4.57.*", ALL_DEVICES,
                "stock transformers 4.57 with pi0align's compatibility layer (5.x moved PI0's Gemma pieces)"),
    Requirement("lerobot", "==0.4.4", ALL_DEVICES, "LeRobot 0.4.4's PI0, installed without its pins"),
    Requirement("torch_npu", "=={torch}.*", ("npu",), "torch_npu must be built for this torch (the same version)"),
    Requirement("cann", ">=8.2", ("npu",), "CANN 8.2 or later (the case study's image: CANN 8.2.RC1)"),
    Requirement("accelerate", ">=1.0", (), "optional: accelerate's launcher for several processes"),
    Requirement("deepspeed", ">=0.14", (), "optional: DeepSpeed for training across nodes"),
    Requirement("msprobe", ">=26.0", (), "optional (mindstudio-probe): msprobe's seed_all, and its dumps"),
]


@dataclass(frozen=True)
class Machine:
    """What `doctor` looks at: library versions (None where absent), the devices present, and the
    environment variables among provenance.NUMERICS_VARIABLES (None where unset)."""

    versions: dict[str, str | None]
    devices: tuple[str, ...]
    environment: dict[str, str | None] = field(default_factory=dict)
    cpu: dict[str, str | None] = field(default_factory=dict)  # device.host_cpu()


@dataclass(frozen=True)
class Finding:
    """One line of the doctor's table."""

    check: str
    found: str
    wanted: str
    status: str
    hint: str


@dataclass(frozen=True)
class Doctor:
    """This machine against SUPPORTED and the switches: True when nothing mismatches."""

    findings: list[Finding]

    def __bool__(self) -> bool:
        return not any(f.status == MISMATCH for f in self.findings)


def doctor(machine: Machine) -> Doctor:
    """The machine's libraries against SUPPORTED, then the switches comparable runs need on the
    devices it has."""
    findings = [_library(requirement, machine) for requirement in SUPPORTED]
    return Doctor(findings + _switches(machine))


def _library(requirement: Requirement, machine: Machine) -> Finding:
    found = machine.versions.get(requirement.name)
    torch = _release(machine.versions.get("torch") or "")
    wanted = requirement.specifier.format(torch=".".join(map(str, torch[:2])) if torch else "?")
    needed = bool(set(requirement.needed_on) & set(machine.devices))
    if found is None:
        status = MISMATCH if needed else NOT_NEEDED if requirement.needed_on else ABSENT
        return Finding(requirement.name, "absent", wanted, status, requirement.hint)
    return Finding(requirement.name, found, wanted, OK if _satisfies(found, wanted) else MISMATCH, requirement.hint)


def _satisfies(version: str, wanted: str) -> bool:
    """Whether a version's leading numbers (CANN's `8.2.RC1`: 8.2; `2.14.1+cpu`: 2.14.1) meet a
    PEP 440 specifier."""
    release = _release(version)
    try:
        return bool(release) and SpecifierSet(wanted).contains(Version(".".join(map(str, release))))
    except InvalidSpecifier:
        return False


def _release(version: str) -> tuple[int, ...]:
    """The leading numbers of a version string: `2.14.1+cpu` -> (2, 14, 1), `8.2.RC1` -> (8, 2)."""
    numbers = []
    for part in version.split("."):
        match = re.match(r"\d+", part)
        if not match:
            break
        numbers.append(int(match.group()))
        if match.end() < len(part):
            break
    return tuple(numbers)


def _switches(machine: Machine) -> list[Finding]:
    """The environment a run needs to be comparable call by call, on the devices present."""
    env = machine.environment
    findings = []
    if "cuda" in machine.devices:
        workspace = env.get("CUBLAS_WORKSPACE_CONFIG")
        findings.append(Finding("CUBLAS_WORKSPACE_CONFIG", workspace or "unset", ":4096:8 or :16:8",
                                OK if workspace in (":4096:8", ":16:8") else MISMATCH,
                                "deterministic cuBLAS needs it: export CUBLAS_WORKSPACE_CONFIG=:4096:8"))
        override = env.get("NVIDIA_TF32_OVERRIDE")
        findings.append(Finding("NVIDIA_TF32_OVERRIDE", override or "unset", "unset or 0",
                                OK if override in (None, "0") else MISMATCH,
                                "it forces TF32 on whatever torch's switches say: unset it"))
    if "npu" in machine.devices:
        hccl = env.get("HCCL_DETERMINISTIC")
        findings.append(Finding("HCCL_DETERMINISTIC", hccl or "unset", "true",
                                OK if (hccl or "").lower() in ("true", "1") else MISMATCH,
                                "deterministic reductions across NPUs: export HCCL_DETERMINISTIC=true"))
    threads = env.get("OMP_NUM_THREADS")
    findings.append(Finding("CPU threads", threads or "unset", "fixed", OK if threads else WARNING,
                            "CPU results are bit-identical only at one thread count: pass --threads N to "
                            "pi0align run, or export OMP_NUM_THREADS=N"))
    if machine.cpu:
        cpu = machine.cpu
        forced = cpu.get("capability_forced")
        found = " · ".join(str(v) for v in (cpu.get("architecture"), cpu.get("model"),
                                            cpu.get("capability") and cpu["capability"] + (" forced" if forced else ""),
                                            cpu.get("blas") and f"{cpu['blas']} {cpu.get('mkl') or ''}".strip(),
                                            cpu.get("onednn") and f"oneDNN {cpu['onednn']}") if v)
        findings.append(Finding("host CPU", found, "the same on the hosts compared", INFO,
                                "PI0's noise and the batch are made on the host's CPU whatever the device: hosts of "
                                "another architecture (an arm64 NPU host, an x86_64 GPU host) or code path round "
                                "them otherwise; env-diff names it, compare holds no call to bit-equality then"
                                + (f" (this one's code path is forced: ATEN_CPU_CAPABILITY={forced})"
                                   if forced else "")))
    return findings


def this_machine() -> Machine:
    """The versions, devices and environment of the machine this runs on (imports torch)."""
    import os

    from pi0align.device import host_cpu
    from pi0align.provenance import NUMERICS_VARIABLES, versions

    return Machine(versions=versions(), devices=tuple(kind for kind in ALL_DEVICES if _present(kind)),
                   environment={name: os.environ.get(name) for name in NUMERICS_VARIABLES}, cpu=host_cpu())


def _present(kind: str) -> bool:
    from pi0align.device import resolve
    from pi0align.errors import UserError

    try:
        resolve(kind)
    except UserError:
        return False
    return True
