"""CuTeDSL LayerNorm (``norm.layer_norm``): forward and backward, 16-byte rows up to N = 262144,
sm_90+; weight and bias each optional, in any float dtype.

Same kernels as RMSNorm (:mod:`._norms`, ``layer=True``): the row is centred in registers before
the variance (two passes over registers, one over memory: no E[x²] - E[x]² cancellation). The
forward saves x, the parameters, mean and rstd; the backward writes dx and sums dW and dB from
per-CTA fp32 partials (deterministic).
"""

from __future__ import annotations

import torch

from .._double_backward import layer_norm_grads
from ._norm_host import norm_backward, norm_forward, rows16, vector16


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):  # type: ignore[override]
        n = x.shape[-1]
        x2, w, b = rows16(x, n), vector16(weight), vector16(bias)
        y, rstd, mean = norm_forward(x2, w, b, eps, 0.0, layer=True, llama=False)
        ctx.save_for_backward(x2, w, rstd, mean, x, weight, bias)  # the inputs: for a create_graph backward
        ctx.shape, ctx.b_dtype, ctx.eps = x.shape, None if bias is None else bias.dtype, eps
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x2, w, rstd, mean, x, weight, bias = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: differentiable gradients, by the torch formula
            return (*layer_norm_grads(x, weight, bias, ctx.eps, dy, ctx.needs_input_grad), None)
        want_dw = w is not None and ctx.needs_input_grad[1]
        want_db = ctx.b_dtype is not None and ctx.needs_input_grad[2]
        dx, dw, db = norm_backward(rows16(dy.to(x2.dtype), x2.shape[1]), x2, w, rstd, mean, 0.0, True, False, want_dw, want_db)
        return (
            dx.view(ctx.shape) if ctx.needs_input_grad[0] else None,
            dw.to(w.dtype) if want_dw else None,
            db.to(ctx.b_dtype) if want_db else None,
            None,
        )


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The registered impl (arguments validated by ``polykernel.layer_norm``)."""
    needs_grad = x.requires_grad or any(p is not None and p.requires_grad for p in (weight, bias))
    if torch.is_grad_enabled() and needs_grad:
        return _LayerNorm.apply(x, weight, bias, eps)
    n = x.shape[-1]
    y, _, _ = norm_forward(rows16(x, n), vector16(weight), vector16(bias), eps, 0.0, layer=True, llama=False)
    return y.view(x.shape)
