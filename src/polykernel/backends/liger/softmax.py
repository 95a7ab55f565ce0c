"""Liger-Kernel softmax (``LigerSoftmaxFunction``) on ``activation.softmax``'s signature.
Its backward uses the saved y in x's dtype (the contract's impls recompute y in fp32)."""

from __future__ import annotations

import torch
from liger_kernel.ops.softmax import LigerSoftmaxFunction

from .._double_backward import refusing
from .._fallback import registered

# what this impl does not take goes to the torch impl, resolved by name on first use (polykernel.backends._fallback)
_torch_softmax = registered("activation.softmax")

# create_graph=True: second derivatives raise, naming the op, instead of reading zeros (refusing();
# Liger keeps y, not x: x is held by an empty anchor)
_Softmax = refusing(LigerSoftmaxFunction, "activation.softmax", "liger", (0,), kept=False)


def softmax(x: torch.Tensor) -> torch.Tensor:
    if x.numel() == 0:
        return _torch_softmax(x)
    return _Softmax.apply(x)
