"""Liger-Kernel softmax (``LigerSoftmaxFunction``) on ``activation.softmax``'s signature.
Its backward uses the saved y in x's dtype (the contract's impls recompute y in fp32)."""

from __future__ import annotations

import torch
from liger_kernel.ops.softmax import LigerSoftmaxFunction

from ..torch.softmax import softmax as _torch_softmax


def softmax(x: torch.Tensor) -> torch.Tensor:
    if x.numel() == 0:
        return _torch_softmax(x)
    return LigerSoftmaxFunction.apply(x)
