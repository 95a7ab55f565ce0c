"""sgl-kernel fused add + RMSNorm (``torch.ops.sgl_kernel.fused_add_rmsnorm`` /
``gemma_fused_add_rmsnorm``) on ``serving.fused_add_rms_norm_``'s signature, in place.

FlashInfer's FusedAddRMSNorm compiled into sgl-kernel: ``residual <- x + residual`` rounded, the
fp32 sum normalised before that rounding (one rounding of s from the op's semantics, inside its
error model). Its kernels take contiguous tensors only: x or residual in another layout goes to the
torch impl.
"""

from __future__ import annotations

import torch

from .._dense import readable, rows, uint32_parts
from .._fallback import registered
from ._ops import ops, pdl

# what this impl does not take goes to the torch impl, resolved by name on first use (polykernel.backends._fallback)
_torch_fused_add_rms_norm_ = registered("serving.fused_add_rms_norm_")


def fused_add_rms_norm_(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float
) -> tuple[torch.Tensor, torch.Tensor]:
    n = x.shape[-1]
    x2, r2 = rows(x, n), rows(residual, n)
    if x.numel() == 0 or x2 is None or r2 is None:
        return _torch_fused_add_rms_norm_(x, residual, weight, eps, offset)
    norm, w, p = (ops.gemma_fused_add_rmsnorm if offset == 1.0 else ops.fused_add_rmsnorm).default, readable(weight), pdl(x)
    for xs, rs in uint32_parts(x2, r2):  # FlashInfer's CUDA kernel: uint32 row offsets (_dense.UINT32_ELEMS)
        norm(xs, rs, w, eps, p)
    return x, residual
