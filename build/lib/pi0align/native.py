"""Native sources (`csrc/*.cpp` beside the module that uses them, shipped as package data),
compiled with the system compiler on first use: C entry points loaded with ctypes (`Library`,
for parts that must not import torch), or a Python extension module (`Extension`).

The sources are compiled where they lie, so a compiler error names the real file and line. Each
build is cached under the pi0align cache, keyed by the sources and the headers beside them, the
flags, the compiler and this CPU (`-march=native`: a library built here must not run on another
CPU). It is written under a temporary name and renamed, so concurrent processes never load a
half-written file. Callers keep a slower path for machines without a compiler.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import platform
import shutil
import tempfile
import threading
import zlib
from pathlib import Path

from pi0align.cache import cache_root

FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC"]


class _Built:
    """Sources compiled once per process, on the first `load()`; `error` says why they could not be."""

    def __init__(self, name: str, sources: list[Path], flags: list[str]) -> None:
        self._name, self._sources, self._flags = name, [Path(s) for s in sources], flags
        self._lock = threading.Lock()
        self._loaded = False
        self.error = ""  # why it could not be built, in one line

    def _build(self) -> None:
        with self._lock:
            if not self._loaded:
                self._loaded = True
                try:
                    self._open(_compiled(self._name, self._sources, self._flags))
                except (OSError, ImportError) as error:
                    self.error = _one_line(error)

    def _open(self, path: Path) -> None:
        raise NotImplementedError


class Library(_Built):
    """A library loaded with ctypes. `functions` names its C entry points (all returning void) with
    their ctypes argument types."""

    def __init__(self, name: str, sources: list[Path], functions: dict[str, list], flags: list[str] = FLAGS) -> None:
        super().__init__(name, sources, flags)
        self._signatures = functions
        self.functions: dict[str, ctypes._CFuncPtr] = {}

    def load(self) -> bool:
        """Whether the library runs in this process."""
        self._build()
        return not self.error

    def _open(self, path: Path) -> None:
        library = ctypes.CDLL(str(path))
        for name, argtypes in self._signatures.items():
            function = self.functions[name] = getattr(library, name)
            function.restype, function.argtypes = None, argtypes


class Extension(_Built):
    """A Python extension module (`PyInit_<name>` in one of `sources`); `module` is None when it
    cannot be built."""

    def __init__(self, name: str, sources: list[Path], flags: list[str]) -> None:
        super().__init__(name, sources, flags)
        self.module = None

    def load(self):
        """The module, or None."""
        self._build()
        return self.module

    def _open(self, path: Path) -> None:
        spec = importlib.util.spec_from_file_location(self._name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        self.module = module


def _one_line(error: Exception) -> str:
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def _compiled(name: str, sources: list[Path], flags: list[str]) -> Path:
    """The shared library compiled from `sources`; OSError when it cannot be built."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise OSError("no C++ compiler (g++ or $CXX) found")
    parts = ["\0".join([*flags, compiler, platform.machine(), _cpu_flags()]).encode()]
    for source in sorted({*sources, *(h for s in sources for h in s.parent.glob("*.h"))}):
        parts.append(source.name.encode() + b"\0" + source.read_bytes())
    folder = cache_root() / "kernels"
    library = folder / f"{name}-{_checksum(parts)}.so"
    if not library.exists():
        import subprocess  # here: a process that finds its libraries built starts no compiler

        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as staging:
            built = os.path.join(staging, f"{name}.so")
            try:
                result = subprocess.run([compiler, *map(str, sources), *flags, "-o", built], capture_output=True,
                                        text=True, timeout=300, check=False)
            except subprocess.SubprocessError as error:
                raise OSError(f"compiling {name} failed: {error}") from None
            if result.returncode != 0:
                lines = result.stderr.strip().splitlines() or ["?"]
                first = next((line for line in lines if ": error:" in line), lines[0])
                raise OSError(f"compiling {name} failed: {first}")
            os.replace(built, library)
    return library


def _checksum(parts: list[bytes]) -> str:
    """64 bits naming a build: zlib's CRC-32 and Adler-32 over the parts and their lengths (a cache
    key, not a defence; hashlib would load OpenSSL into every compare that reads msprobe's JSON)."""
    crc, adler = 0, 1
    for part in parts:
        framed = len(part).to_bytes(8, "little") + part
        crc, adler = zlib.crc32(framed, crc), zlib.adler32(framed, adler)
    return f"{crc:08x}{adler:08x}"


def _cpu_flags() -> str:
    """The CPU's feature line."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""
