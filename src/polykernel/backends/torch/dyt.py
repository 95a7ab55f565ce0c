"""PyTorch DyT: the reference's fp32 math, with a backward that saves x and the parameters only.

Plain autograd through the reference would keep fp32 copies of x and tanh(alpha·x) (4x a bf16
input); this Function recomputes t = tanh(alpha·x) in the backward, with the aten kernel autograd
would call for ``1 - t²`` (``tanh_backward``), so the results match the reference's autograd.
"""

from __future__ import annotations

import math

import torch

from ...ops.dyt import reference
from .._double_backward import graph_grads

_transforms_active = torch._C._are_functorch_transforms_active


class _DyT(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, alpha, weight, bias):  # type: ignore[override]
        ctx.save_for_backward(x, alpha, weight, bias)
        return reference(x, alpha, weight, bias)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x, alpha, weight, bias = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: the reference's differentiable gradients
            return tuple(graph_grads(reference, (x, alpha, weight, bias), (dy,), ctx.needs_input_grad))
        acc = torch.promote_types(x.dtype, torch.float32)
        rows, n = math.prod(x.shape[:-1]), x.shape[-1]  # (not -1 rows: ambiguous when n = 0)
        a, xf, dyf = alpha.to(acc).reshape(()), x.to(acc), dy.to(acc)
        t = torch.tanh(a * xf)
        g = torch.ops.aten.tanh_backward(dyf * weight.to(acc), t)  # dy·w·(1 - t²)
        need = ctx.needs_input_grad
        dx = (g * a).to(x.dtype) if need[0] else None
        da = (g * xf).sum().reshape(alpha.shape).to(alpha.dtype) if need[1] else None
        dw = (dyf * t).reshape(rows, n).sum(0).to(weight.dtype) if need[2] else None
        db = dyf.reshape(rows, n).sum(0).to(bias.dtype) if need[3] else None
        return dx, da, dw, db


def dyt(x: torch.Tensor, alpha: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    grad = x.requires_grad or alpha.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    # Under functorch transforms (grad, vmap) the reference's plain torch ops, which they take.
    if grad and torch.is_grad_enabled() and not _transforms_active():
        return _DyT.apply(x, alpha, weight, bias)
    return reference(x, alpha, weight, bias)
