"""sgl-kernel ``torch.ops.sgl_kernel.rotary_embedding`` (vLLM's kernel) on
``serving.rotary_embedding_``'s signature, in place, float32 only (the gate: it computes in the
tensors' own dtype).

The kernel reads int64 positions and a cache of the query's dtype (an int32 positions tensor and a
16-bit cache are widened: exact; a float64 cache goes to the torch impl), walks q and k by their
row stride and the query's head stride (last dim contiguous, one head stride for q and k), and
needs the query's heads to be a multiple of the key's (else the torch impl). Positions outside the cache are not guarded: it reads the row they
name (ours write NaN).
"""

from __future__ import annotations

import torch

from .._fallback import registered
from ._ops import ops

# what this impl does not take goes to the torch impl, resolved by name on first use (polykernel.backends._fallback)
_torch_rotary_embedding_ = registered("serving.rotary_embedding_")


def _heads(t: torch.Tensor, head_size: int) -> int:
    return t.shape[1] if t.dim() == 3 else t.shape[1] // head_size


def _head_stride(t: torch.Tensor, head_size: int) -> int:
    return t.stride(1) if t.dim() == 3 else head_size


def _takes(query: torch.Tensor, key: torch.Tensor | None, head_size: int) -> bool:
    """Whether the kernel addresses q and k as they are: last dims contiguous, one head stride for
    both (it reads the query's), whole groups of query heads per key head."""
    if query.stride(-1) != 1:
        return False
    if key is None:
        return True
    return (
        key.stride(-1) == 1
        and _head_stride(key, head_size) == _head_stride(query, head_size)
        and not _heads(query, head_size) % _heads(key, head_size)
    )


def rotary_embedding_(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
    rotary_dim: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if positions.shape[0] == 0 or query.dtype != torch.float32 or cos_sin_cache.dtype == torch.float64 or not _takes(query, key, head_size):
        return _torch_rotary_embedding_(positions, query, key, head_size, cos_sin_cache, is_neox, rotary_dim)
    cache = cos_sin_cache.to(query.dtype).contiguous()
    ops.rotary_embedding.default(positions.long().contiguous(), query, key, head_size, cache, is_neox)
    return query, key
