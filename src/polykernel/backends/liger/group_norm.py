"""Liger-Kernel GroupNorm (``LigerGroupNormFunction``) on ``norm.group_norm``'s signature (weight
and bias both given, in x's dtype: the predicate excludes the other cases). Liger views x as
``[N, G, L]`` (a contiguous copy when it is not) and accumulates dW, dB with atomics."""

from __future__ import annotations

import torch
from liger_kernel.ops.group_norm import LigerGroupNormFunction

from .._double_backward import refusing
from .._fallback import registered

# what this impl does not take goes to the torch impl, resolved by name on first use (polykernel.backends._fallback)
_torch_group_norm = registered("norm.group_norm")

# create_graph=True: second derivatives raise, naming the op, instead of reading zeros (refusing())
_GroupNorm = refusing(LigerGroupNormFunction, "norm.group_norm", "liger", (0, 1, 2))


def group_norm(x: torch.Tensor, num_groups: int, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    if x.numel() == 0 or weight is None or bias is None:  # Liger's view(N, G, -1) of an empty x
        return _torch_group_norm(x, num_groups, weight, bias, eps)
    return _GroupNorm.apply(x, weight, bias, x.shape[1], num_groups, eps)
