"""Liger-Kernel PolyNorm (``LigerPolyNormFunction``) on ``norm.poly_norm``'s signature (fp32, weight
and bias in x's dtype: the predicate and the dtype gate exclude the rest). ``in_place=False``:
Liger's default writes dX into the incoming gradient dY. Liger's backward returns dbias 0-dim: a
``[1]`` bias goes in reshaped to ``[]`` (a view, so its gradient comes back ``[1]``)."""

from __future__ import annotations

import torch
from liger_kernel.ops.poly_norm import LigerPolyNormFunction

from .._double_backward import refusing
from .._fallback import registered

# what this impl does not take goes to the torch impl, resolved by name on first use (polykernel.backends._fallback)
_torch_poly_norm = registered("norm.poly_norm")

# create_graph=True: second derivatives raise, naming the op, instead of reading zeros (refusing())
_PolyNorm = refusing(LigerPolyNormFunction, "norm.poly_norm", "liger", (0, 1, 2))


def poly_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    if x.numel() == 0:  # Liger's x.view(-1, dim) fails on empty rows
        return _torch_poly_norm(x, weight, bias, eps)
    return _PolyNorm.apply(x, weight, bias.reshape(()), eps, False)
