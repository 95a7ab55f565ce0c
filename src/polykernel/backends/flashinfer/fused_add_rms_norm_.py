"""FlashInfer fused add + RMSNorm (``flashinfer.norm.fused_add_rmsnorm`` / ``gemma_fused_add_rmsnorm``)
on ``serving.fused_add_rms_norm_``'s signature, in place.

FlashInfer writes ``residual <- x + residual`` rounded, and normalises the fp32 sum before that
rounding (the op's semantics normalise the rounded sum): one rounding of s apart, inside the op's
error model (which counts it). Its kernels write through dense rows only: x or residual in another
layout (a strided view, an unaligned slice) goes to the torch impl.
"""

from __future__ import annotations

import torch
from flashinfer.norm import fused_add_rmsnorm, gemma_fused_add_rmsnorm

from .._dense import readable, rows, uint32_parts
from .._fallback import registered

# what this impl does not take goes to the torch impl, resolved by name on first use (polykernel.backends._fallback)
_torch_fused_add_rms_norm_ = registered("serving.fused_add_rms_norm_")


def fused_add_rms_norm_(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float
) -> tuple[torch.Tensor, torch.Tensor]:
    n = x.shape[-1]
    x2, r2 = rows(x, n), rows(residual, n)
    if x.numel() == 0 or x2 is None or r2 is None:
        return _torch_fused_add_rms_norm_(x, residual, weight, eps, offset)
    norm, w = (gemma_fused_add_rmsnorm if offset == 1.0 else fused_add_rmsnorm), readable(weight)
    for xs, rs in uint32_parts(x2, r2):  # its CUDA kernel's row offsets are uint32 (_dense.UINT32_ELEMS)
        norm(xs, rs, w, eps)
    return x, residual
