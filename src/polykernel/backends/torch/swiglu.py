"""PyTorch SwiGLU: the reference's fp32 math, with a backward that saves only gate and up.

Plain autograd through the reference would keep fp32 copies of gate, up and silu(gate) (6x a
bf16 input); this Function recomputes them in the backward with the same aten kernels that
autograd would call (``silu_backward``), so the results match the reference bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ... import _compat
from ...ops.swiglu import reference
from .._double_backward import graph_grads

_transforms_active = _compat.functorch_transforms_active


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):  # type: ignore[override]
        ctx.save_for_backward(gate, up)
        return reference(gate, up)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        gate, up = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: silu_backward has no derivative; the reference's
            return tuple(graph_grads(reference, (gate, up), (dy,), ctx.needs_input_grad))
        acc = torch.promote_types(gate.dtype, torch.float32)
        g, dyf = gate.to(acc), dy.to(acc)
        dgate = torch.ops.aten.silu_backward(dyf * up.to(acc), g).to(gate.dtype) if ctx.needs_input_grad[0] else None
        dup = (dyf * F.silu(g)).to(up.dtype) if ctx.needs_input_grad[1] else None
        return dgate, dup


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    # Under functorch transforms (grad, vmap) the reference's plain torch ops, which they take.
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad) and not _transforms_active():
        return _SwiGLU.apply(gate, up)
    return reference(gate, up)
