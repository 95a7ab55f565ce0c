"""Liger-Kernel RMSNorm (``LigerRMSNormFunction``) on ``norm.rms_norm``'s signature.

casting="fp32" is Liger's "gemma" mode (x, w in fp32, one cast at the end); "llama" is Liger's
"llama" (x̂ cast to x.dtype before the weight multiply). ``offset`` is Liger's offset.
``in_place=False``: Liger's default writes dX into the incoming gradient dY.
"""

from __future__ import annotations

import torch
from liger_kernel.ops.rms_norm import LigerRMSNormFunction

from .._double_backward import refusing
from .._fallback import registered

# what this impl does not take goes to the torch impl, resolved by name on first use (polykernel.backends._fallback)
_torch_rms_norm = registered("norm.rms_norm")

# create_graph=True: second derivatives raise, naming the op, instead of reading zeros (refusing())
_RMSNorm = refusing(LigerRMSNormFunction, "norm.rms_norm", "liger", (0, 1))


_MODES = {"fp32": "gemma", "llama": "llama"}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, casting: str) -> torch.Tensor:
    if x.numel() == 0:  # Liger's x.view(-1, 0) fails on empty rows
        return _torch_rms_norm(x, weight, eps, offset, casting)
    return _RMSNorm.apply(x, weight, eps, offset, _MODES[casting], False)
