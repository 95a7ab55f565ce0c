"""PyTorch softmax: ``torch.softmax`` over the last dim.

PyTorch's kernels accumulate in fp32 for bf16/fp16 inputs and return the input dtype, which is
the op's forward contract. Its backward, though, uses the saved output in the input dtype, whose
rounding leaks into ``Σ dy·y``; for bf16/fp16 this Function saves x instead and recomputes the
fp32 y in the backward (``_softmax_backward_data`` in fp32), as the contract's fp32 math says.
"""

from __future__ import annotations

import torch

from ... import _compat
from ...ops.softmax import reference
from ...spec import Split
from .._double_backward import graph_grads

_transforms_active = _compat.functorch_transforms_active


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        ctx.save_for_backward(x)
        return torch.softmax(x, dim=-1)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: the reference's differentiable gradient
            return graph_grads(reference, (x,), (dy,), (True,))[0]
        y = torch.softmax(x.float(), dim=-1)
        return _compat.softmax_backward_data(dy.float(), y, -1, torch.float32).to(x.dtype)


def softmax(x: torch.Tensor) -> torch.Tensor:
    if x.dtype in (torch.float32, torch.float64) or not (torch.is_grad_enabled() and x.requires_grad):
        return torch.softmax(x, dim=-1)
    if _transforms_active():  # functorch (grad, vmap): the reference's plain torch ops, which they take
        return reference(x)
    return _Softmax.apply(x)


# Forward and backward as separate functions, for compiled graphs (polykernel.compile.library). This
# split defines the op's saved layout, which every impl's split follows: each row's max and 1/sum
# ([M] each, in the accumulation dtype: fp32, fp64 for fp64 x), from which the backward rebuilds
# y in that dtype. Not y itself: in bf16 its rounding would leak into Σ dy·y (see above), and the
# rows' stats are 8 bytes where y is 2·N (x is kept for the backward anyway).
def _split_forward(x, grad_mask):
    acc = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(acc)
    if x.shape[-1] == 0:  # amax of an empty row raises; the stats are never read then
        rmax = rinv = xf.new_zeros(x.shape[:-1])
        return (torch.empty_like(x),), (rmax.reshape(-1), rinv.reshape(-1))
    rmax = xf.amax(-1, keepdim=True)
    e = (xf - rmax).exp()
    rinv = e.sum(-1, keepdim=True).reciprocal()
    return ((e * rinv).to(x.dtype),), (rmax.reshape(-1), rinv.reshape(-1))


def _split_backward(grads, saved, x, grad_mask):
    # dx = y·(dy - Σ dy·y), with y = exp(x - max)·(1/sum) rebuilt in the accumulation dtype.
    acc = torch.promote_types(x.dtype, torch.float32)
    rmax, rinv = (s.to(acc).view(*x.shape[:-1], 1) for s in saved)
    y = (x.to(acc) - rmax).exp() * rinv
    dy = grads[0].to(acc)
    return [(y * (dy - (dy * y).sum(-1, keepdim=True))).to(x.dtype)]


softmax.split = Split(forward=_split_forward, backward=_split_backward)  # type: ignore[attr-defined]
