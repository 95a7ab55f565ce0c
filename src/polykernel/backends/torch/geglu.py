"""PyTorch GeGLU: the reference's fp32 math, with a backward that saves only gate and up.

Plain autograd through the reference would keep fp32 copies of gate, up and gelu(gate); this
Function recomputes them in the backward with the aten kernels autograd would call
(``gelu_backward``), so the results match the reference bit for bit.
"""

from __future__ import annotations

import torch

from ... import _compat
from ...ops.geglu import gelu, reference
from .._double_backward import graph_grads

_transforms_active = _compat.functorch_transforms_active


class _GeGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, approximate):  # type: ignore[override]
        ctx.save_for_backward(gate, up)
        ctx.approximate = approximate
        return reference(gate, up, approximate)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        gate, up = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: the reference's differentiable gradients
            args = (gate, up, ctx.approximate)
            return tuple(graph_grads(reference, args, (dy,), ctx.needs_input_grad))
        acc = torch.promote_types(gate.dtype, torch.float32)
        g, dyf = gate.to(acc), dy.to(acc)
        dgate = dup = None
        if ctx.needs_input_grad[0]:
            dgate = torch.ops.aten.gelu_backward(dyf * up.to(acc), g, approximate=ctx.approximate).to(gate.dtype)
        if ctx.needs_input_grad[1]:
            dup = (dyf * gelu(g, ctx.approximate)).to(up.dtype)  # the forward's gelu (inf at +inf)
        return dgate, dup, None


def geglu(gate: torch.Tensor, up: torch.Tensor, approximate: str) -> torch.Tensor:
    # Under functorch transforms (grad, vmap) the reference's plain torch ops, which they take.
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad) and not _transforms_active():
        return _GeGLU.apply(gate, up, approximate)
    return reference(gate, up, approximate)
