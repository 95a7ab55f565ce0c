"""FlashInfer ``flashinfer.rope.apply_rope_with_cos_sin_cache_inplace`` on
``serving.rotary_embedding_``'s signature (vLLM's layout, which FlashInfer's function mirrors).

FlashInfer reads the cache in fp32 (a 16-bit cache is widened: exact; a float64 one goes to the
torch impl, whose fp64 rows FlashInfer cannot read), rotates in fp32 and rounds once, through q's and
k's own row and head strides (last dim contiguous). Positions outside the cache are not guarded:
FlashInfer reads the row they name (ours write NaN); call it with checked positions.

Its kernel (include/flashinfer/pos_enc.cuh, BatchQKApplyRotaryPosIdsCosSinCacheKernel and its
head-parallel twin) loads and stores each head 16 bytes at a time from ``q + n·stride_n +
h·stride_h``, and the cache's cos/sin as fp32 vectors from ``cache + pos·rotary_dim``: a query or
key whose data pointer or row / head stride is not a multiple of 16 bytes (a slice of a buffer at
an odd offset, rows of an odd width) would fault with a misaligned address, so it goes to the torch
impl; the cache is handed over dense and aligned (a copy when it is not).
"""

from __future__ import annotations

import torch
from flashinfer.rope import apply_rope_with_cos_sin_cache_inplace

from .._dense import readable, vectors
from .._fallback import registered

# what this impl does not take goes to the torch impl, resolved by name on first use (polykernel.backends._fallback)
_torch_rotary_embedding_ = registered("serving.rotary_embedding_")


def _heads(t: torch.Tensor, head_size: int) -> torch.Tensor:
    """``[T, H, head_size]`` view, as FlashInfer's wrapper makes it (a 2-D row's heads are head_size apart)."""
    return t if t.dim() == 3 else t.unflatten(-1, (-1, head_size))


def rotary_embedding_(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
    rotary_dim: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if (
        key is None  # (the gate refuses it; forced by name, the torch impl keeps the contract)
        or positions.shape[0] == 0
        or cos_sin_cache.dtype == torch.float64
        or not vectors(_heads(query, head_size))
        or not vectors(_heads(key, head_size))
    ):
        return _torch_rotary_embedding_(positions, query, key, head_size, cos_sin_cache, is_neox, rotary_dim)
    cache = cos_sin_cache if cos_sin_cache.dtype == torch.float32 else cos_sin_cache.float()
    apply_rope_with_cos_sin_cache_inplace(positions.contiguous(), query, key, head_size, readable(cache), is_neox)
    return query, key
