"""The native dump backend: `csrc/capture_extension.cpp`, `csrc/api_calls.cpp`,
`csrc/call_description.cpp`, `csrc/calls_table.cpp` and `csrc/element_statistics.cpp`, built into
one torch extension on first use (pi0align/native.py).

Its handler of a step's API calls (of the common call, which writes none of its arguments),
autograd hooks, argument flattening, call sites, arguments' JSON, the calls table's rows and step
records run in C++; CPU tensors' statistics and samples are read in one pass by the kernel's own
thread while training goes on, and tensor mode's copies for the writer are made there too (queued
tensors are kept alive there, and waited for before an in-place call could change them). Tensors
the kernel does not take (accelerator tensors, unusual dtypes) get the torch backend's batched
statistics (stats.py).
"""

from __future__ import annotations

import atexit
import functools
import os
import sysconfig
from pathlib import Path

import numpy as np
import torch

from pi0align.dump.backends.stats import BatchedStatistics, finish_statistics
from pi0align.dump.backends.steplog import dtype_name
from pi0align.dump.writing.captured_step import CodedColumn
from pi0align.native import FLAGS, Extension

_SOURCES = [Path(__file__).parent.parent / "csrc" / name
            for name in ("capture_extension.cpp", "api_calls.cpp", "call_description.cpp", "calls_table.cpp",
                         "element_statistics.cpp")]
# dtype -> the kernel's element kind (element_statistics.h)
KINDS = {torch.bool: 0, torch.uint8: 1, torch.int8: 2, torch.int16: 3, torch.bfloat16: 4, torch.float16: 5,
         torch.int32: 6, torch.float32: 7, torch.int64: 8, torch.float64: 9}


class NativeBackend:
    """The loaded extension; `NativeBackend.load()` builds it once per process."""

    name = "native"

    def __init__(self, module) -> None:
        self.module = module
        self.status = "compiled"
        self.host_gather = _HostGather(module)
        self.copier = _QueuedCopies(module)
        self.tensors_of = module.tensors_of
        self.input_edges = module.input_edges
        self.watch = module.watch
        self.watch_tensor_grads = module.watch_tensor_grads
        self.describe_arguments, self.call_site = module.describe_arguments, module.call_site
        self.api_handler = module.api_handler
        self.module_handlers = (module.enter_module, module.leave_module)

    @staticmethod
    @functools.cache
    def load() -> NativeBackend | str:
        """The backend, or why the extension cannot be built here (one line)."""
        extension = Extension("pi0align_capture", _SOURCES, [*FLAGS, "-pthread", *_torch_flags()])
        module = extension.load()
        if module is None:
            return extension.error
        for dtype, kind in KINDS.items():
            module.set_kind(torch.empty(0, dtype=dtype), kind)
        module.describe_records(torch.Tensor, torch.nn.Parameter, lambda tensor: dtype_name(tensor.dtype))
        os.register_at_fork(after_in_child=module.forget)  # the parent's queue and thread are not in the child
        atexit.register(module.wait)  # no queued job may outlive the tensors it reads
        return NativeBackend(module)

    def records(self, in_place_seen: bool, tensor_sink, sampler) -> NativeRecords:
        return NativeRecords(self.module, in_place_seen, tensor_sink, sampler)


class NativeRecords:
    """A step's records, kept by the extension's recorder."""

    def __init__(self, module, in_place_seen: bool, tensor_sink, sampler) -> None:
        self._module = module
        self._others = BatchedStatistics(in_place_seen)  # tensors the kernel does not take
        self._recorder = module.recorder(in_place_seen, self._others.add, tensor_sink,
                                         sampler.add if sampler is not None else None,
                                         sampler.native_cache if sampler is not None else None)
        self.calls_table = (module.open_call, module.open_backward)

    def record(self, call_id: int, name: str, role: str, arg_index: int, tensors: list[torch.Tensor]) -> int:
        return self._module.record(self._recorder, call_id, name, role, arg_index, tensors)

    def set_call(self, row: int, call_id: int) -> None:
        self._module.set_call(self._recorder, row, call_id)

    def grad_sink(self, name: str, forward_id: int, open_backward):
        return self._module.backward_call(self._recorder, name, open_backward, forward_id)

    def before_change(self, tensors: list[torch.Tensor]) -> None:
        self._module.wait()
        self._others.before_change(tensors)

    def drain(self) -> None:
        self._module.wait()
        self._others.flush()

    def close(self) -> None:
        self._module.close(self._recorder)

    def columns(self) -> dict[str, np.ndarray | CodedColumn]:
        call_id, arg_index, numel, slot, sample_row, *texts = self._module.columns(self._recorder)
        columns = {"call_id": np.frombuffer(call_id, np.int64), "arg_index": np.frombuffer(arg_index, np.int32),
                   "numel": np.frombuffer(numel, np.int64), "slot": np.frombuffer(slot, np.int64),
                   "sample_row": np.frombuffer(sample_row, np.int64)}
        columns.update((name, CodedColumn(np.frombuffer(codes, np.int32), values))
                       for name, (codes, values) in zip(("role", "dtype", "shape", "tensor", "skipped"), texts))
        return columns

    def statistics(self) -> tuple[np.ndarray, np.ndarray]:
        self.drain()
        floats, ints, numel = self._module.statistics(self._recorder)
        floats = np.frombuffer(floats, np.float64).reshape(-1, 4).copy()
        ints = np.frombuffer(ints, np.int64).reshape(-1, 3).copy()
        self._others.collect(floats, ints)
        finish_statistics(floats, ints, np.frombuffer(numel, np.int64).astype(np.float64))
        return floats, ints


class _HostGather:
    """Sample mode's gather of CPU tensors straight into a host table, now or on the kernel's thread;
    with a cache of the sampler's layouts, by which the recorder gathers a record whose layout was
    seen before without asking the sampler."""

    def __init__(self, module) -> None:
        self._module = module
        self.remember, self.set_host = module.remember, module.set_host

    @staticmethod
    def takes(tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu" and tensor.dtype in KINDS

    def gather(self, tensor: torch.Tensor, offsets: int, count: int, values: int, queued: bool) -> None:
        """The `count` elements at the memory offsets of the int64 array at address `offsets` (kept
        alive and unchanged until `wait()` when queued) into the float64 array at address `values`."""
        self._module.gather(tensor, offsets, count, values, queued)

    def wait(self) -> None:
        self._module.wait()

    def sample_cache(self, position_rows: list, counts: list, queued: bool):
        """The cache of a sampler whose per-step rows are these lists (appended to, cleared in place)."""
        return self._module.sample_cache(position_rows, counts, queued)


class _QueuedCopies:
    """Tensor mode's copies of CPU tensors into the writer's ring, made on the kernel's thread."""

    def __init__(self, module) -> None:
        self.queue, self.finished, self.wait = module.queue_copy, module.finished, module.wait


def _torch_flags() -> list[str]:
    """Build against the running torch and Python; the torch version is in the flags, hence in the
    cache key, so a reinstalled torch gets its own build."""
    root = os.path.dirname(torch.__file__)
    lib = os.path.join(root, "lib")
    return ["-std=c++20", "-w", f"-DPI0ALIGN_TORCH={torch.__version__}",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}",
            "-I", os.path.join(root, "include"), "-I", sysconfig.get_paths()["include"],
            "-L", lib, "-ltorch", "-ltorch_cpu", "-ltorch_python", "-lc10", f"-Wl,-rpath,{lib}"]
