"""Run LeRobot 0.4.4's PI0 on stock transformers 4.57.

LeRobot's PI0 was written against a patched transformers (openpi's `transformers_replace`, on a git
branch only). For PI0 (not PI0.5: no adaptive RMSNorm) the patch matters in four places, and this
module supplies exactly those, only when the patched build is absent:

- `GemmaRMSNorm.forward(x, cond=None)` returns `(normed, gate)` when called with `cond` (LeRobot's
  layer loop does); called without it, it keeps the stock single-tensor return for stock layers;
- `modeling_gemma._gated_residual(x, y, gate)`;
- SigLIP's encoder casts the (float32) patch embeddings to bfloat16 when its layers are bfloat16
  (PI0 keeps the patch embedding in float32 under `dtype=bfloat16`);
- `transformers.models.siglip.check.check_whether_transformers_replace_is_installed_correctly()`.

The numerics are stock transformers'; the manifest records that this layer was applied.
"""

from __future__ import annotations

import importlib
import sys
import types

import torch

_NO_COND = object()


_applied: str | None = None


def patched_transformers_present() -> bool:
    try:
        importlib.import_module("transformers.models.siglip.check")
    except ImportError:
        return False
    return True


def apply() -> str:
    """Make transformers serve LeRobot's PI0; idempotent. Returns "patched-build" or "pi0align-compat"."""
    global _applied
    if _applied is None:
        _applied = "patched-build" if patched_transformers_present() else _install()
    return _applied


def _install() -> str:
    from transformers.models.gemma import modeling_gemma

    stock_forward = modeling_gemma.GemmaRMSNorm.forward

    def forward(self, x, cond=_NO_COND):
        if cond is _NO_COND:
            return stock_forward(self, x)
        if cond is not None:
            raise NotImplementedError("adaptive RMSNorm (PI0.5) needs the patched transformers build")
        return stock_forward(self, x), None

    modeling_gemma.GemmaRMSNorm.forward = forward
    modeling_gemma._gated_residual = _gated_residual

    from transformers.models.siglip import modeling_siglip

    stock_encoder_forward = modeling_siglip.SiglipEncoder.forward

    def encoder_forward(self, inputs_embeds, *args, **kwargs):
        if self.layers and self.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16:
            inputs_embeds = inputs_embeds.to(torch.bfloat16)
        return stock_encoder_forward(self, inputs_embeds, *args, **kwargs)

    modeling_siglip.SiglipEncoder.forward = encoder_forward
    check = types.ModuleType("transformers.models.siglip.check")
    check.check_whether_transformers_replace_is_installed_correctly = lambda: True
    sys.modules[check.__name__] = check
    importlib.import_module("transformers.models.siglip").check = check
    return "pi0align-compat"


def _gated_residual(x, y, gate):
    """x + y, or x + y * gate when a gate is given (openpi's signature, None-tolerant)."""
    if x is None or y is None:
        return y if x is None else x
    return x + y if gate is None else x + y * gate
