"""PyTorch RMSNorm: ``F.rms_norm`` (PyTorch's fused kernel) where its semantics match ours."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...ops.rms_norm import reference
from ...spec import Split


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, casting: str) -> torch.Tensor:
    # F.rms_norm upcasts to fp32, multiplies by the weight in fp32 and casts once: our "fp32"
    # casting, when the weight has x's dtype (with another dtype its output dtype differs) and
    # there is no offset (weight + offset in bf16 would round Gemma's 1 + w before the multiply).
    if casting == "fp32" and offset == 0.0 and weight.dtype == x.dtype and x.dtype != torch.float64:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return reference(x, weight, eps, offset, casting)


# Forward and backward as separate functions, for compiled graphs (polykernel.compile.library). This
# split defines the op's saved layout, which every impl's split follows: rstd, fp32, [M] (one per
# row of x viewed as [M, N]).
def _split_forward(x, weight, eps, offset, casting, grad_mask):
    acc = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(acc)
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    xhat = xf * rstd
    if casting == "llama":
        xhat = xhat.to(x.dtype).to(acc)
    y = (xhat * (weight.to(acc) + offset)).to(x.dtype)
    return (y,), (rstd.reshape(-1).to(torch.float32),)


def _split_backward(grads, saved, x, weight, eps, offset, casting, grad_mask):
    # dx = rstd·(g - x̂·mean(g·x̂)) with g = dy·(w + offset); dW = Σ_rows dy·x̂ (x̂ rounded as the
    # forward rounds it with casting="llama", which also rounds g).
    acc = torch.promote_types(x.dtype, torch.float32)
    n = x.shape[-1]
    rstd = saved[0].to(acc).view(*x.shape[:-1], 1)
    xhat = x.to(acc) * rstd
    dy = grads[0].to(acc)
    g = dy * (weight.to(acc) + offset)
    xr = xhat
    if casting == "llama":
        g = g.to(x.dtype).to(acc)
        xr = xhat.to(x.dtype).to(acc)
    dx = (g - xhat * (g * xhat).sum(-1, keepdim=True) / max(n, 1)) * rstd if grad_mask[0] else None
    dw = (dy * xr).reshape(-1, n).sum(0).to(weight.dtype) if grad_mask[1] else None
    return [None if dx is None else dx.to(x.dtype), dw, None, None, None]


rms_norm.split = Split(forward=_split_forward, backward=_split_backward)  # type: ignore[attr-defined]
