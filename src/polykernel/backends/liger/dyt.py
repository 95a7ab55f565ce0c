"""Liger-Kernel DyT (``LigerDyTFunction``) on ``norm.dyt``'s signature (alpha, weight and bias in
x's dtype: the predicate excludes the rest). Liger's backward returns dalpha as ``[1]``: a 0-dim
alpha goes in reshaped to ``[1]`` (a view, so its gradient comes back 0-dim)."""

from __future__ import annotations

import torch
from liger_kernel.ops.dyt import LigerDyTFunction

from .._double_backward import refusing
from .._fallback import registered

# what this impl does not take goes to the torch impl, resolved by name on first use (polykernel.backends._fallback)
_torch_dyt = registered("norm.dyt")

# create_graph=True: second derivatives raise, naming the op, instead of reading zeros (refusing())
_DyT = refusing(LigerDyTFunction, "norm.dyt", "liger", (0, 1, 2, 3))


def dyt(x: torch.Tensor, alpha: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if x.numel() == 0:  # Liger launches a grid of M rows
        return _torch_dyt(x, alpha, weight, bias)
    return _DyT.apply(x, alpha.reshape(1), weight, bias)
