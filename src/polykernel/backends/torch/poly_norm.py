"""PyTorch PolyNorm: the reference's fp32 math, with a backward that saves x and the parameters.

Plain autograd through the reference would keep fp32 copies of x, x², x³ and their three
normalized forms (10x a bf16 input); this Function recomputes them in the backward, with the
closed form of each RMS normalisation's backward: ``r·(g - n·mean(g·n))``, on x scaled per row as
the reference scales it (``ops.poly_norm.scaled``: x⁶ would overflow fp32 from |x| > 2.6e6).
"""

from __future__ import annotations

import torch

from ...ops.poly_norm import reference, scaled
from .._double_backward import graph_grads

_transforms_active = torch._C._are_functorch_transforms_active


class _PolyNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):  # type: ignore[override]
        ctx.save_for_backward(x, weight, bias)
        ctx.eps = eps
        return reference(x, weight, bias, eps)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x, weight, bias = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: the reference's differentiable gradients
            return (*graph_grads(reference, (x, weight, bias, ctx.eps), (dy,), (*ctx.needs_input_grad[:3], False)),)
        acc = torch.promote_types(x.dtype, torch.float32)
        g, w = dy.to(acc), weight.to(acc)
        v, inv, tails = scaled(x.to(acc), ctx.eps)  # x/s per row, as the reference computes
        dv = torch.zeros_like(v)
        dw = []
        for i, (p, t) in enumerate(zip((3, 2, 1), tails)):  # weight's order: x³, x², x
            u = v.pow(p)
            r = torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + t)
            n = u * r
            gn = g * n
            dw.append(gn.sum())
            gw = g * w[i]
            du = r * (gw - n * (gw * n).mean(-1, keepdim=True))
            dv = dv + du * (p * v.pow(p - 1))
        dx = dv * inv  # y depends on x through v = x/s
        need = ctx.needs_input_grad
        return (
            dx.to(x.dtype) if need[0] else None,
            torch.stack(dw).to(weight.dtype) if need[1] else None,
            g.sum().reshape(bias.shape).to(bias.dtype) if need[2] else None,
            None,
        )


def poly_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    # Under functorch transforms (grad, vmap) the reference's plain torch ops, which they take.
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or bias.requires_grad) and not _transforms_active():
        return _PolyNorm.apply(x, weight, bias, eps)
    return reference(x, weight, bias, eps)
