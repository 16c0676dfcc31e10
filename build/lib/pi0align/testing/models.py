"""Small models with the shapes of trouble seen in PI0: norms, a fused qkv projection with bias
(whose key part has a gradient that is zero in exact arithmetic), attention written by hand or
through `scaled_dot_product_attention`, GELU MLPs, residuals."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F  # noqa: N812


class Mlp(torch.nn.Module):
    """Linear → LayerNorm → GELU blocks, then a head."""

    def __init__(self, width: int = 48, depth: int = 4) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.LayerNorm(width), torch.nn.GELU())
            for _ in range(depth))
        self.head = torch.nn.Linear(width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Attention(torch.nn.Module):
    def __init__(self, width: int, heads: int, sdpa: bool) -> None:
        super().__init__()
        self.heads, self.sdpa = heads, sdpa
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.out = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        if self.sdpa:
            mixed = F.scaled_dot_product_attention(q, k, v)
        else:
            weights = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1]), dim=-1)
            mixed = torch.matmul(weights, v)
        return self.out(mixed.transpose(1, 2).reshape(batch, length, width))


class Layer(torch.nn.Module):
    def __init__(self, width: int, heads: int, sdpa: bool) -> None:
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.attention = Attention(width, heads, sdpa)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 2 * width), torch.nn.GELU(),
                                       torch.nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Transformer(torch.nn.Module):
    """Pre-norm transformer layers on (batch, length, width) inputs, then a head."""

    def __init__(self, width: int = 32, heads: int = 4, depth: int = 2, sdpa: bool = False) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(Layer(width, heads, sdpa) for _ in range(depth))
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))

    def use_sdpa(self, sdpa: bool) -> None:
        for layer in self.layers:
            layer.attention.sdpa = sdpa


class HandWrittenAdamW(torch.optim.Optimizer):
    """AdamW as a user might write it: torch.optim.AdamW's update with its operations in another
    order (bias corrections applied to the moments, the decay folded into the same expression).
    `kernel_eps`, `kernel_lr_scale`: a kernel that computes with another epsilon, or another
    learning rate, than its settings say (as a fused kernel with a constant of its own would)."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, kernel_eps: float | None = None, kernel_lr_scale: float = 1.0) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.kernel_eps, self.kernel_lr_scale = kernel_eps, kernel_lr_scale

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(param), torch.zeros_like(param)
                state["step"] += 1
                step = state["step"].item()
                grad = param.grad
                state["exp_avg"].copy_(beta1 * state["exp_avg"] + (1 - beta1) * grad)
                state["exp_avg_sq"].copy_(beta2 * state["exp_avg_sq"] + (1 - beta2) * grad * grad)
                corrected_mean = state["exp_avg"] / (1 - beta1**step)
                corrected_square = state["exp_avg_sq"] / (1 - beta2**step)
                eps = group["eps"] if self.kernel_eps is None else self.kernel_eps
                lr = group["lr"] * self.kernel_lr_scale
                update = corrected_mean / (corrected_square.sqrt() + eps)
                param.copy_(param * (1 - lr * group["weight_decay"]) - lr * update)
