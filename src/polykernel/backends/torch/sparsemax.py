"""PyTorch sparsemax: the reference's sort-based threshold in fp32, with a backward that needs
no sort.

Autograd through the reference would keep the sorted fp32 rows and their int64 indices (6x a
bf16 input, plus the cumsum); this Function saves x and two fp32 numbers per row (the row's max
m and the threshold τ of ``x - m``) and rebuilds the support ``{x - m > τ}`` in the backward:
``dx = dy - mean_S(dy)`` on it, 0 elsewhere (and on the rows that come back NaN).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...ops.sparsemax import reference, threshold
from .._double_backward import graph_grads

_transforms_active = torch._C._are_functorch_transforms_active


def _stats(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y in the accumulation dtype, m, τ) of x moved to ``[..., n]``; τ is NaN on bad rows."""
    acc = torch.promote_types(x.dtype, torch.float32)
    z = x.to(acc).movedim(dim, -1)
    m = z.amax(-1, keepdim=True)
    zc = z - m
    tau = threshold(zc)
    good = torch.isfinite(m)
    tau = torch.where(good, tau, float("nan"))  # the backward's support is then empty
    return torch.where(good, F.relu(zc - tau), float("nan")), m, tau


class _Sparsemax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim):  # type: ignore[override]
        y, m, tau = _stats(x, dim)
        ctx.save_for_backward(x, m, tau)
        ctx.dim = dim
        return y.movedim(-1, dim).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x, m, tau = ctx.saved_tensors
        dim = ctx.dim
        if torch.is_grad_enabled():  # create_graph=True: the reference's differentiable gradient
            return graph_grads(reference, (x, dim), (dy,), (True, False))[0], None
        support = x.to(m.dtype).movedim(dim, -1) - m > tau
        g = torch.where(support, dy.to(m.dtype).movedim(dim, -1), 0.0)
        mean = g.sum(-1, keepdim=True) / support.sum(-1, keepdim=True).clamp_min(1)
        return torch.where(support, g - mean, 0.0).movedim(-1, dim).to(x.dtype), None


def sparsemax(x: torch.Tensor, dim: int) -> torch.Tensor:
    if x.numel() == 0 or _transforms_active():  # (functorch: the reference's plain torch ops, which it takes)
        return reference(x, dim)
    if torch.is_grad_enabled() and x.requires_grad:
        return _Sparsemax.apply(x, dim)
    with torch.no_grad():
        return _stats(x, dim)[0].movedim(-1, dim).to(x.dtype)
