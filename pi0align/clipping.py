"""The gradients clipped as LeRobot's training clips them (`torch.nn.utils.clip_grad_norm_`, L2,
`error_if_nonfinite=False`), in its two halves: the norms, then the scaling. Between them a monitor
is handed each gradient's norm as the clip computed it, before the gradients are scaled: the
gradients' norms cost it no pass of its own over them. Shared by `run`'s engines (train/engines.py)
and by `attach`, which clips an unmodified script's `clip_grad_norm_` calls with it."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype, _has_foreach_support

GradientNorms = Mapping[int, torch.Tensor]
"""id(gradient) → its L2 norm (0-dim, in the gradient's dtype, on its device)."""


@torch.no_grad()
def clip_gradients(parameters: torch.Tensor | Iterable[torch.Tensor], max_norm: float,
                   before_scaling: Callable[[GradientNorms], None] | None = None) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_(parameters, max_norm)`, bit for bit (tests/test_clipping.py),
    with `before_scaling(norms)` called between its norms and its scaling; returns the total norm."""
    parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        total = torch.tensor(0.0)
        norms = {}
    else:
        # as torch's `_get_total_norm` (torch/nn/utils/clip_grad.py): per device and dtype, torch's
        # multi-tensor norm where it has one; the total over the norms in that order
        ordered: list[torch.Tensor] = []
        norms = {}
        for (device, _), ([group], _) in _group_tensors_by_device_and_dtype([grads]).items():
            found = (torch._foreach_norm(group, 2.0) if _has_foreach_support(group, device)
                     else [torch.linalg.vector_norm(g, 2.0) for g in group])
            ordered.extend(found)
            norms.update(zip(map(id, group), found))
        total = torch.linalg.vector_norm(torch.stack([n.to(grads[0].device) for n in ordered]), 2.0)
    if before_scaling is not None:
        before_scaling(norms)
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total)
    return total
