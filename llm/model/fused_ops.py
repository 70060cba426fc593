"""RMSNorm and rotary position embedding (RoPE; its angles: rotary.py), fused, with hand-written backward passes.

Each kernel is an ``autograd.Function`` that makes fewer passes over its input than autograd's record of
the composed ops. Under ``torch.compile`` the composed ops are used instead: the compiler fuses them
itself and does not support ``out=`` writes into slices. tests/model/test_modeling.py checks each kernel
against the composed ops (values and gradients), test_lm_head.py the compiled step against the eager one.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)``, normalised in fp32 as in Qwen3 (bf16 would round the mean)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # the composed ops, which the compiler fuses itself
            x32 = x.to(torch.promote_types(x.dtype, torch.float32))
            x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
            return self.weight * x32.to(x.dtype)
        return _RMSNorm.apply(x, self.weight, self.eps)


class _RMSNorm(torch.autograd.Function):
    """``RMSNorm.forward`` with a hand-written backward: 3 passes over x forward and about 6 backward,
    where autograd's record of the composed ops takes 4 and 10."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # Autocast would run vecdot in bf16 on CPU: the mean of squares must stay in fp32.
        with torch.autocast(x.device.type, enabled=False):
            x32 = x.to(torch.promote_types(x.dtype, torch.float32))
            rstd = torch.linalg.vecdot(x32, x32).unsqueeze(-1).div_(x.shape[-1]).add_(eps).rsqrt_()
        ctx.save_for_backward(x, weight, rstd)
        return weight * (x32 * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, weight, rstd = ctx.saved_tensors
        with torch.autocast(x.device.type, enabled=False):  # a backward called inside autocast, too
            grad = grad.to(rstd.dtype)  # bf16 when the weight is (model.to(bf16), FSDP2/DeepSpeed bf16)
            normed = x.to(rstd.dtype) * rstd
            grad_weight = torch.linalg.vecdot(grad.reshape(-1, x.shape[-1]), normed.reshape(-1, x.shape[-1]), dim=0)
            grad_normed = grad * weight
            # d/dx of x * rstd(x): rstd * (g - normed * mean(g * normed))
            mean_dot = torch.linalg.vecdot(grad_normed, normed).unsqueeze(-1).div_(x.shape[-1])
            grad_x = torch.addcmul(grad_normed, normed, mean_dot, value=-1).mul_(rstd)
        return grad_x.to(x.dtype), grad_weight.to(weight.dtype), None


class _Rotary(torch.autograd.Function):
    """``x * cos + rotate_half(x) * sin``, with ``rotate_half([x1, x2]) = [-x2, x1]``, written half by half
    into one output (two passes over x where the composed ops take five); the backward pass is the
    rotation by the opposite angles, ``rotate(grad, cos, -sin)``."""

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        cos, sin = cos[..., :half], sin[..., :half]  # both halves of the tables are equal
        out = torch.empty(torch.broadcast_shapes(x.shape, (*cos.shape[:-1], x.shape[-1])),
                          dtype=torch.promote_types(x.dtype, cos.dtype), device=x.device)
        torch.mul(x1, cos, out=out[..., :half]).addcmul_(x2, sin, value=-1)  # x1 cos - x2 sin
        torch.mul(x2, cos, out=out[..., half:]).addcmul_(x1, sin)  # x2 cos + x1 sin
        return out

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        ctx.x_dtype = x.dtype
        return _Rotary.rotate(x, cos, sin)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        return _Rotary.rotate(grad, cos, -sin).to(ctx.x_dtype), None, None


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[B, heads, T, D]`` by its positions' angles (cos, sin ``[B, T, R]``, no gradient; rotary.py):
    its first R dimensions, the rest passing unrotated when ``partial_rotary_factor`` makes R < D.

    Under ``torch.compile`` the composed ops are left to the compiler, which fuses them itself (and does
    not support the ``out=`` writes into slices that ``_Rotary`` uses).
    """
    if (rotary_dim := cos.shape[-1]) < x.shape[-1]:
        return torch.cat([apply_rotary(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]], dim=-1)
    cos, sin = cos[:, None], sin[:, None]
    if torch.compiler.is_compiling():
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin
    return _Rotary.apply(x, cos, sin)
