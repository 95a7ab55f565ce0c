"""FlashInfer RMSNorm (``flashinfer.norm.rmsnorm`` / ``gemma_rmsnorm``) on ``norm.rms_norm``'s
signature, forward only (its row has no backward: with a gradient wanted the dispatcher passes it by).

FlashInfer normalises in fp32 and rounds once (casting="fp32"); ``gemma_rmsnorm`` is offset=1.
The gate (``_gates.rms_norm``) refuses other castings, offsets and a weight of another dtype.
"""

from __future__ import annotations

import torch
from flashinfer.norm import gemma_rmsnorm, rmsnorm

from .._dense import readable, uint32_parts
from .._fallback import registered

# what this impl does not take goes to the torch impl, resolved by name on first use (polykernel.backends._fallback)
_torch_rms_norm = registered("norm.rms_norm")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, casting: str) -> torch.Tensor:
    n = x.shape[-1]
    if x.numel() == 0:
        return _torch_rms_norm(x, weight, eps, offset, casting)
    x2 = readable(x).view(-1, n)
    out = torch.empty_like(x2)
    norm, w = (gemma_rmsnorm if offset == 1.0 else rmsnorm), readable(weight)
    for xs, ys in uint32_parts(x2, out):  # its CUDA kernel's row offsets are uint32 (_dense.UINT32_ELEMS)
        norm(xs, w, eps, out=ys)
    return out.view(x.shape)
