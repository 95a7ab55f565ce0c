"""QuACK fused add + RMSNorm (``quack.rmsnorm.rmsnorm(x, w, residual=r, prenorm=True)``) on
``norm.fused_add_rms_norm``'s signature.

QuACK returns s = x + residual rounded to x's dtype, as the contract does, but normalizes the
unrounded fp32 sum (the contract normalizes the rounded s): in bf16/fp16, y may differ from the
reference by about one more ulp. Its backward adds the gradient of s into both x and residual.
"""

from __future__ import annotations

import torch
from quack.rmsnorm import rmsnorm as _quack_rmsnorm

from .._dense import readable
from .._fallback import registered
from ._rows import rows

# what this impl does not take goes to the torch impl, resolved by name on first use (polykernel.backends._fallback)
_torch_impl = registered("norm.fused_add_rms_norm")


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float
) -> tuple[torch.Tensor, torch.Tensor]:
    n = x.shape[-1]
    if x.numel() == 0:
        return _torch_impl(x, residual, weight, eps, offset)
    y, s = _quack_rmsnorm(rows(x, n), readable(weight), residual=rows(residual, n), eps=eps, prenorm=True, weight_offset=float(offset))
    return y.view(x.shape), s.view(x.shape)
