"""Liger-Kernel LayerNorm (``LigerLayerNormFunction``) on ``norm.layer_norm``'s signature
(weight and bias both given: the predicate excludes the other cases)."""

from __future__ import annotations

import torch
from liger_kernel.ops.layer_norm import LigerLayerNormFunction

from .._double_backward import refusing
from .._fallback import registered

# what this impl does not take goes to the torch impl, resolved by name on first use (polykernel.backends._fallback)
_torch_layer_norm = registered("norm.layer_norm")

# create_graph=True: second derivatives raise, naming the op, instead of reading zeros (refusing())
_LayerNorm = refusing(LigerLayerNormFunction, "norm.layer_norm", "liger", (0, 1, 2))


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    if x.numel() == 0 or weight is None or bias is None:
        return _torch_layer_norm(x, weight, bias, eps)
    return _LayerNorm.apply(x, weight, bias, eps)
