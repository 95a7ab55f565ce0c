"""Liger-Kernel GeGLU (``LigerGELUMulFunction``, tanh GELU only) on ``activation.geglu``'s
signature. Like its SwiGLU, Liger rounds gelu(gate) to up's dtype before the multiply."""

from __future__ import annotations

import torch
from liger_kernel.ops.geglu import LigerGELUMulFunction

from .._double_backward import refusing
from .._fallback import registered
from ._glu import private

# what this impl does not take goes to the torch impl, resolved by name on first use (polykernel.backends._fallback)
_torch_geglu = registered("activation.geglu")

# create_graph=True: second derivatives raise, naming the op, instead of reading zeros (refusing())
_GELUMul = refusing(LigerGELUMulFunction, "activation.geglu", "liger", (0, 1))


def geglu(gate: torch.Tensor, up: torch.Tensor, approximate: str) -> torch.Tensor:
    if gate.numel() == 0 or gate.dim() == 0 or approximate != "tanh":  # Liger indexes the last dim
        return _torch_geglu(gate, up, approximate)
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        gate, up = private(gate), private(up)
    return _GELUMul.apply(gate, up)
