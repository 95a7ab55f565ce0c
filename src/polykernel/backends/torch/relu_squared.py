"""PyTorch ReLU²: the reference's fp32 math, with a backward that saves only x.

Plain autograd through the reference would keep an fp32 copy of relu(x) (2x a bf16 input); this
Function recomputes ``2·relu(x)`` from x in the backward (0 where x <= 0; a NaN stays NaN, as
in torch's relu backward).
"""

from __future__ import annotations

import torch

from ...ops.relu_squared import reference
from .._double_backward import graph_grads

_transforms_active = torch._C._are_functorch_transforms_active


class _ReLUSquared(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        ctx.save_for_backward(x)
        return reference(x)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: the reference's differentiable gradient
            return graph_grads(reference, (x,), (dy,), (True,))[0]
        acc = torch.promote_types(x.dtype, torch.float32)
        xf = x.to(acc)
        return torch.where(xf <= 0, 0.0, 2 * xf * dy.to(acc)).to(x.dtype)  # NaN stays NaN, as torch's relu backward


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    # Under functorch transforms (grad, vmap) the reference's plain torch ops, which they take.
    if torch.is_grad_enabled() and x.requires_grad and not _transforms_active():
        return _ReLUSquared.apply(x)
    return reference(x)
