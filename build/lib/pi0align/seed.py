"""`seed_all(seed, mode, rm_dropout)`: msprobe's when installed, our equivalent otherwise.

Ours fixes every random source a PI0 training touches and, like msprobe's, is process-wide:
it is called once, at the start of a run.
"""

from __future__ import annotations

import functools
import os
import random

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812

SEED_IMPLEMENTATIONS = ("msprobe", "pi0align")

# NPU collective-communication determinism (HCCL / LCCL), read by CANN at communicator creation.
NPU_DETERMINISM_ENV = {"HCCL_DETERMINISTIC": "true", "LCCL_DETERMINISTIC": "1"}


def seed_all(seed: int = 1234, mode: bool = True, rm_dropout: bool = True, prefer: str = "msprobe") -> str:
    """Fix every random source; returns which implementation ran ("msprobe" or "pi0align").

    `mode` turns on deterministic algorithms; `rm_dropout` makes every dropout an identity.
    `prefer="pi0align"` skips msprobe even when it is installed.
    """
    if prefer not in SEED_IMPLEMENTATIONS:
        raise ValueError(f"prefer must be one of {SEED_IMPLEMENTATIONS}")
    if prefer == "msprobe":
        try:
            from msprobe.pytorch import seed_all as msprobe_seed_all
        except ImportError:
            pass
        else:
            msprobe_seed_all(seed=seed, mode=mode, rm_dropout=rm_dropout)
            return "msprobe"
    seed_all_pi0align(seed, mode=mode, rm_dropout=rm_dropout)
    return "pi0align"


def seed_all_pi0align(seed: int, mode: bool = True, rm_dropout: bool = True) -> None:
    """Our equivalent of msprobe's seed_all."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # seeds the CPU generator and every accelerator's default generators
    # Child processes (dataloader workers, launcher ranks) hash strings the same way.
    os.environ["PYTHONHASHSEED"] = str(seed)
    for module_name in ("cuda", "npu"):
        module = getattr(torch, module_name, None)
        if module is not None and module.is_available():
            module.manual_seed_all(seed)
    if mode:
        # cuBLAS needs a fixed workspace for deterministic GEMMs; must be set before the first call.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        os.environ.update(NPU_DETERMINISM_ENV)
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.enabled = True
    if rm_dropout:
        remove_dropout()


# Every dropout entry point, with the name and position of its probability argument.
_DROPOUT_FUNCTIONS = [
    *[(F, name, "p", 1) for name in ("dropout", "dropout1d", "dropout2d", "dropout3d")],
    *[(F, name, "p", 1) for name in ("alpha_dropout", "feature_alpha_dropout")],
    *[(torch, name, "p", 1) for name in ("dropout", "alpha_dropout", "feature_dropout", "feature_alpha_dropout")],
    (F, "scaled_dot_product_attention", "dropout_p", 4),
]
_PATCHED = "_pi0align_no_dropout"


def remove_dropout() -> None:
    """Force the dropout probability to 0 in every dropout path (nn.Dropout modules call F.dropout).

    Idempotent. The call still goes through the original function, so autograd sees the same graph.
    """
    for owner, attribute, probability_name, position in _DROPOUT_FUNCTIONS:
        original = getattr(owner, attribute, None)
        if original is None or getattr(original, _PATCHED, False):
            continue
        setattr(owner, attribute, _with_zero_probability(original, probability_name, position))


def _with_zero_probability(original, probability_name: str, position: int):
    @functools.wraps(original)
    def without_dropout(*args, **kwargs):
        if len(args) > position:
            args = (*args[:position], 0.0, *args[position + 1 :])
        else:  # given by keyword, or left at its non-zero default
            kwargs[probability_name] = 0.0
        return original(*args, **kwargs)

    setattr(without_dropout, _PATCHED, True)
    return without_dropout
