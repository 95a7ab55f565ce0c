"""PyTorch LayerNorm: ``F.layer_norm`` (PyTorch's fused kernel) where its semantics match ours."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...ops.layer_norm import reference
from ...spec import Split

# PyTorch's CPU backward for bf16/fp16 builds dW from low-precision intermediates (measured: 0.64
# off on a bf16 dW of 8.7 when mean(x) = 40); there, the fp32 reference is the accurate choice.
_CPU_NATIVE = (torch.float32, torch.float64)


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    # F.layer_norm computes the statistics and the affine step in fp32 (opmath) and casts once:
    # our semantics, when the parameters have x's dtype (with another dtype, its CPU and CUDA
    # kernels differ in what they accept and return) and the row is not empty.
    # A bias without a weight: the reference too (F.layer_norm's double backward raises an
    # internal error there: "Expected a proper Tensor but got None", torch 2.13).
    if (
        all(p is None or p.dtype == x.dtype for p in (weight, bias))
        and (weight is not None or bias is None)
        and x.shape[-1] > 0
        and (x.device.type != "cpu" or x.dtype in _CPU_NATIVE)
    ):
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    return reference(x, weight, bias, eps)


# Forward and backward as separate functions, for compiled graphs (polykernel.compile.library). This
# split defines the op's saved layout, which every impl's split follows: mean and rstd, [M] each
# (one per row of x viewed as [M, N]), in the accumulation dtype (fp32; fp64 for fp64 x).
def _split_forward(x, weight, bias, eps, grad_mask):
    acc = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(acc)
    mean = xf.mean(-1, keepdim=True)
    xc = xf - mean
    rstd = torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
    y = xc * rstd
    if weight is not None:
        y = y * weight.to(acc)
    if bias is not None:
        y = y + bias.to(acc)
    return (y.to(x.dtype),), (mean.reshape(-1), rstd.reshape(-1))


def _split_backward(grads, saved, x, weight, bias, eps, grad_mask):
    # x̂ = (x - mean)·rstd, g = dy·w: dx = rstd·(g - mean(g) - x̂·mean(g·x̂)); dW = Σ dy·x̂, dB = Σ dy.
    acc = torch.promote_types(x.dtype, torch.float32)
    n = x.shape[-1]
    mean, rstd = (s.to(acc).view(*x.shape[:-1], 1) for s in saved)
    xhat = (x.to(acc) - mean) * rstd
    dy = grads[0].to(acc)
    dx = dw = db = None
    if grad_mask[0]:
        g = dy * weight.to(acc) if weight is not None else dy
        dx = (rstd * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))).to(x.dtype)
    if weight is not None and grad_mask[1]:
        dw = (dy * xhat).reshape(-1, n).sum(0).to(weight.dtype)
    if bias is not None and grad_mask[2]:
        db = dy.reshape(-1, n).sum(0).to(bias.dtype)
    return [dx, dw, db, None]


layer_norm.split = Split(forward=_split_forward, backward=_split_backward)  # type: ignore[attr-defined]
