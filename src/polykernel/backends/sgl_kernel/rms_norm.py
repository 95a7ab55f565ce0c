"""sgl-kernel RMSNorm (``torch.ops.sgl_kernel.rmsnorm`` / ``gemma_rmsnorm``) on ``norm.rms_norm``'s
signature, forward only (its row has no backward).

FlashInfer's norm kernel compiled into sgl-kernel: fp32, one rounding (casting="fp32"); gemma is
offset=1. The gate refuses other castings, offsets and a weight of another dtype.
"""

from __future__ import annotations

import torch

from .._dense import readable, uint32_parts
from .._fallback import registered
from ._ops import ops, pdl

# what this impl does not take goes to the torch impl, resolved by name on first use (polykernel.backends._fallback)
_torch_rms_norm = registered("norm.rms_norm")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, casting: str) -> torch.Tensor:
    n = x.shape[-1]
    if x.numel() == 0:
        return _torch_rms_norm(x, weight, eps, offset, casting)
    x2 = readable(x).view(-1, n)
    out = torch.empty_like(x2)
    norm, w, p = (ops.gemma_rmsnorm if offset == 1.0 else ops.rmsnorm).default, readable(weight), pdl(x)
    for xs, ys in uint32_parts(x2, out):  # FlashInfer's CUDA kernel: uint32 row offsets (_dense.UINT32_ELEMS)
        norm(ys, xs, w, eps, p)
    return out.view(x.shape)
