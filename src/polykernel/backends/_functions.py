"""autograd nodes shared by the kernel backends (Triton, cuTile), each built around one backend's
host launchers: the save/recompute logic is the same whatever runs the kernels.

Example::

    _Rope, _forward = rope_function(rope_launch)   # rope_launch(q, k, cos, sin, qo, ko, backward=...)
    GLUFunction = glu_function(glu_forward, glu_backward)
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ._double_backward import glu_grads, rope_grads


def rope_function(rope_launch: Callable[..., None]) -> tuple[type[torch.autograd.Function], Callable]:
    """(the RoPE autograd Function, its forward) around ``rope_launch(q, k, cos, sin, qo, ko,
    backward=..., interleaved=...)``, which writes rot(q) / rot(k) into qo / ko (either pair may be
    None). Partial rotary follows from the tables' width; ``interleaved`` is passed only when set,
    so a launcher without that option (cuTile's) serves the default path."""

    def forward(
        q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        qo, ko = torch.empty_like(q), torch.empty_like(k)  # q's / k's dense layout (no copy of a view)
        if interleaved:
            rope_launch(q, k, cos, sin, qo, ko, backward=False, interleaved=True)
        else:
            rope_launch(q, k, cos, sin, qo, ko, backward=False)
        return qo, ko

    class _Rope(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, cos, sin, interleaved=False):  # type: ignore[override]
            qo, ko = forward(q, k, cos, sin, interleaved)
            ctx.save_for_backward(cos, sin)
            ctx.layouts = ((q.shape, qo.stride()), (k.shape, ko.stride()))
            ctx.interleaved = interleaved
            ctx.set_materialize_grads(False)
            return qo, ko

        @staticmethod
        def backward(ctx, gq, gk):  # type: ignore[override]
            cos, sin = ctx.saved_tensors
            if torch.is_grad_enabled():  # create_graph=True: differentiable gradients, by the torch formula
                return (*rope_grads(cos, sin, gq, gk, ctx.needs_input_grad, ctx.interleaved), None, None, None)
            (q_shape, q_stride), (k_shape, k_stride) = ctx.layouts
            gq = gq if ctx.needs_input_grad[0] else None
            gk = gk if ctx.needs_input_grad[1] else None
            dq = torch.empty_strided(q_shape, q_stride, dtype=gq.dtype, device=gq.device) if gq is not None else None
            dk = torch.empty_strided(k_shape, k_stride, dtype=gk.dtype, device=gk.device) if gk is not None else None
            if ctx.interleaved:
                rope_launch(gq, gk, cos, sin, dq, dk, backward=True, interleaved=True)
            else:
                rope_launch(gq, gk, cos, sin, dq, dk, backward=True)
            return dq, dk, None, None, None

    return _Rope, forward


def glu_function(glu_forward: Callable[..., torch.Tensor], glu_backward: Callable[..., tuple]) -> type[torch.autograd.Function]:
    """The autograd Function for ``act(gate) * up`` around ``glu_forward(gate, up, act)`` and
    ``glu_backward(dy, gate, up, act) -> (dgate, dup)``; saves only gate and up."""

    class GLUFunction(torch.autograd.Function):
        """autograd for ``act(gate) * up``; saves only gate and up."""

        @staticmethod
        def forward(ctx, gate, up, act):  # type: ignore[override]
            ctx.save_for_backward(gate, up)
            ctx.act = act
            return glu_forward(gate, up, act)

        @staticmethod
        def backward(ctx, dy):  # type: ignore[override]
            gate, up = ctx.saved_tensors
            if torch.is_grad_enabled():  # create_graph=True: differentiable gradients, by the torch formula
                return (*glu_grads(gate, up, ctx.act, dy, ctx.needs_input_grad), None)
            dg, du = glu_backward(dy, gate, up, ctx.act)
            return (dg if ctx.needs_input_grad[0] else None, du if ctx.needs_input_grad[1] else None, None)

    return GLUFunction
