"""CuTeDSL RMSNorm (``norm.rms_norm``): forward and backward, 16-byte rows up to N = 262144, sm_90+.

Kernels in :mod:`._norms` (rows in registers, 128-bit vectors, warp -> block -> cluster sums;
rows past 16K elements split over a thread-block cluster that meets in distributed shared memory),
host launchers in :mod:`._norm_host`; this file holds the autograd function and the registered
impl. The forward saves x (as 16-byte rows), the weight and rstd; the backward writes dx and sums
dW from per-CTA fp32 partials (no atomics: deterministic). Both castings and any ``offset``.
"""

from __future__ import annotations

import torch

from .._double_backward import rms_norm_grads
from ._norm_host import norm_backward, norm_forward, rows16, vector16


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, offset, casting):  # type: ignore[override]
        n = x.shape[-1]
        x2, w = rows16(x, n), vector16(weight)
        y, rstd, _ = norm_forward(x2, w, None, eps, offset, layer=False, llama=casting == "llama")
        ctx.save_for_backward(x2, w, rstd, x, weight)  # x, weight: a create_graph backward differentiates through them
        ctx.offset, ctx.llama, ctx.shape, ctx.eps, ctx.casting = offset, casting == "llama", x.shape, eps, casting
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x2, w, rstd, x, weight = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: differentiable gradients, by the torch formula
            return (*rms_norm_grads(x, weight, ctx.eps, ctx.offset, ctx.casting, dy, ctx.needs_input_grad), None, None, None)
        want_dw = ctx.needs_input_grad[1]
        dx, dw, _ = norm_backward(rows16(dy.to(x2.dtype), x2.shape[1]), x2, w, rstd, None, ctx.offset, False, ctx.llama, want_dw, False)
        return (
            dx.view(ctx.shape) if ctx.needs_input_grad[0] else None,
            dw.to(w.dtype) if want_dw else None,
            None,
            None,
            None,
        )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, casting: str) -> torch.Tensor:
    """The registered impl (arguments validated by ``polykernel.rms_norm``; the predicate in
    :mod:`._gates` admitted the dtype and N)."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _RMSNorm.apply(x, weight, eps, offset, casting)
    n = x.shape[-1]
    y, _, _ = norm_forward(rows16(x, n), vector16(weight), None, eps, offset, layer=False, llama=casting == "llama")
    return y.view(x.shape)
