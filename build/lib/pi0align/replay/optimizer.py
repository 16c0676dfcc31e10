"""The optimizer's update of one parameter, recomputed in float64 from what one side recorded
(docs/dump-format.md, `Optimizer.step`): the parameter (input 0), its gradient after clipping
(input 1), its states before the update (inputs 2 on, in the order of their names; none at the
first update) and the parameter group's hyper-parameters. torch.optim's Adam, AdamW and SGD, as
torch computes them (single-tensor form), named by the class the dump records: another
optimizer, or one that subclasses them, may compute something else; the results are the updated
parameter (output 0) and states (outputs 2 on, in the order of their names).
"""

from __future__ import annotations

import math

import torch

from pi0align.replay.apis import NotReplayable


def replay_update(described: dict, inputs: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """The float64 update: {output index: tensor}. NotReplayable for another optimizer."""
    settings, names, kind = (described.get(k) for k in ("hyper_parameters", "state", "optimizer"))
    if not isinstance(settings, dict) or not isinstance(names, list) or len(inputs) < 2:
        raise NotReplayable("optimizer settings not recorded")
    if kind not in UPDATES:
        raise NotReplayable(f"optimizer {kind or '(class not recorded)'} is not replayed "
                            "(torch.optim's Adam, AdamW and SGD are)")
    param, grad = inputs[0].clone(), inputs[1]
    before = dict(zip(sorted(names), inputs[2:])) if len(inputs) > 2 else {}
    if settings.get("maximize"):
        grad = -grad
    state = UPDATES[kind](param, grad, before, settings)
    missing = set(names) - set(state)
    if missing:
        raise NotReplayable(f"state {sorted(missing)[0]!r} of this optimizer is not replayed")
    return {0: param, **{index: state[name] for index, name in enumerate(sorted(names), start=2)}}


def _number(settings: dict, key: str) -> float:
    value = settings.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise NotReplayable(f"optimizer setting {key!r} not recorded")
    return float(value)


def _adam(param: torch.Tensor, grad: torch.Tensor, before: dict, settings: dict) -> dict[str, torch.Tensor]:
    """torch.optim.Adam / AdamW (`_single_tensor_adam`), amsgrad included."""
    lr, eps, decay = (_number(settings, k) for k in ("lr", "eps", "weight_decay"))
    beta1, beta2 = (float(b) for b in settings["betas"])
    step = float(before["step"]) + 1 if "step" in before else 1.0
    if decay:
        if settings.get("decoupled_weight_decay"):
            param.mul_(1 - lr * decay)
        else:
            grad = grad + decay * param
    exp_avg = before.get("exp_avg", torch.zeros_like(param)).lerp(grad, 1 - beta1)
    exp_avg_sq = before.get("exp_avg_sq", torch.zeros_like(param)) * beta2 + (1 - beta2) * grad * grad
    state = {"step": torch.tensor(step, dtype=torch.float64), "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    second = exp_avg_sq
    if settings.get("amsgrad"):
        second = state["max_exp_avg_sq"] = torch.maximum(before.get("max_exp_avg_sq", torch.zeros_like(param)),
                                                         exp_avg_sq)
    denominator = second.sqrt() / math.sqrt(1 - beta2**step) + eps
    param.add_(exp_avg / denominator, alpha=-lr / (1 - beta1**step))
    return state


def _sgd(param: torch.Tensor, grad: torch.Tensor, before: dict, settings: dict) -> dict[str, torch.Tensor]:
    """torch.optim.SGD (`_single_tensor_sgd`)."""
    lr, momentum, dampening, decay = (_number(settings, k) for k in ("lr", "momentum", "dampening", "weight_decay"))
    if decay:
        grad = grad + decay * param
    state = {}
    if momentum:
        buffer = before.get("momentum_buffer")
        buffer = grad.clone() if buffer is None else buffer * momentum + (1 - dampening) * grad
        state["momentum_buffer"] = buffer
        grad = grad + momentum * buffer if settings.get("nesterov") else buffer
    param.add_(grad, alpha=-lr)
    return state


UPDATES = {"torch.optim.adam.Adam": _adam, "torch.optim.adamw.AdamW": _adam, "torch.optim.sgd.SGD": _sgd}
