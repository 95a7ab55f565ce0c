"""PyTorch rotary_embedding_ (vLLM's layout, in place): the op's reference (an ``index_select``
of the tokens' cache rows, the fp32 rotation, copied back over the rotated features)."""

from __future__ import annotations

import torch

from ...ops.rotary_embedding_ import reference


def rotary_embedding_(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
    rotary_dim: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    return reference(positions, query, key, head_size, cos_sin_cache, is_neox, rotary_dim)
