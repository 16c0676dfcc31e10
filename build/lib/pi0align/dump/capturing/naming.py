"""API names of captured functions, and per-step counters that turn them into stable names.

`name = "<module path>/<API>#<k>"` (`next_name`), `k` counting calls of that API under that module
path within the step and direction, so an extra or fused call in one module never renames those of
another.
"""

from __future__ import annotations

import functools
import sys

import torch
import torch.nn.functional as F  # noqa: N812

# Tensor methods that only read metadata or convert to Python: never recorded.
_METADATA = frozenset(
    "size dim stride numel nelement element_size is_contiguous is_floating_point is_complex "
    "data_ptr storage_offset untyped_storage get_device tolist item __len__ __bool__ __index__ "
    "__int__ __float__ __format__ __repr__ __hash__ __iter__ __reduce_ex__ __contains__ "
    "__array__ __dlpack__ __dlpack_device__ __deepcopy__ has_names requires_grad_ retain_grad "
    "register_hook register_post_accumulate_grad_hook".split()
)


class ApiNames:
    """Maps a function seen by `__torch_function__` to its API name, or None when not recorded."""

    def __init__(self) -> None:
        self._names: dict[object, str | None] = {}
        # Most specific first: a function reachable from several namespaces takes the first name.
        namespaces = [("Tensor", torch.Tensor), ("Functional", F), ("Torch", torch)]
        if "torch_npu" in sys.modules:  # imported by the training script when it runs on an NPU
            namespaces.append(("NPU", sys.modules["torch_npu"]))
        for prefix, namespace in namespaces:
            for attr in dir(namespace):
                try:
                    value = getattr(namespace, attr)
                    hash(value)
                except Exception:  # noqa: BLE001 - odd attributes (deprecated, unhashable) are not APIs
                    continue
                if callable(value) and not isinstance(value, type):
                    skip = prefix == "Tensor" and attr in _METADATA
                    self._names.setdefault(value, None if skip else f"{prefix}.{attr}")

    def __call__(self, func) -> str | None:
        try:
            return self._names[func]
        except KeyError:
            pass
        except TypeError:  # unhashable callable
            return _fallback_name(func)
        name = None if getattr(func, "__name__", "") in ("__get__", "__set__") else _fallback_name(func)
        self._names[func] = name
        return name


def _fallback_name(func) -> str:
    """Functions found in no namespace (torch internals, torch_npu submodules): by their origin."""
    module = getattr(func, "__module__", "") or ""
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
    if module.startswith("torch_npu"):
        return f"NPU.{name}"
    if module.startswith("torch.nn.functional"):
        return f"Functional.{name}"
    return f"Torch.{name}"


def next_name(counts: dict[tuple[str, str, str], int], module: str, api: str, direction: str) -> str:
    """The name of the next (module, api, direction) call, counted in `counts` (the step's: cleared
    at each)."""
    key = (module, api, direction)
    k = counts.get(key, 0)
    counts[key] = k + 1
    return f"{module}/{api}#{k}"


# Calls that update tensor arguments without saying so: the running statistics of normalisations.
_UPDATES_ARGUMENTS = frozenset({"Functional.batch_norm", "Functional.instance_norm", "Torch.batch_norm",
                                "Torch.instance_norm"})


def is_inplace(api: str, kwargs: dict) -> bool:
    """Whether a call may write into one of its tensor arguments (their statistics come first)."""
    return _writes_arguments(api) or (bool(kwargs) and (kwargs.get("out") is not None or kwargs.get("inplace") is True))


@functools.cache
def _writes_arguments(api: str) -> bool:
    """Whether the API itself writes into an argument, whatever the call's keywords."""
    method = api.rsplit(".", 1)[-1]
    if api in _UPDATES_ARGUMENTS:
        return True
    if method.startswith("__"):
        return method.startswith("__i") or method == "__setitem__"
    return method.endswith("_")
