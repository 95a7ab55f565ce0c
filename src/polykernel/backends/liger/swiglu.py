"""Liger-Kernel SwiGLU (``LigerSiLUMulFunction``) on ``activation.swiglu``'s signature.

Liger rounds silu(gate) to up's dtype before the multiply (Hugging Face's order): in bf16/fp16
that is one more rounding than the contract's single fp32 expression (within ~1 ulp).
"""

from __future__ import annotations

import torch
from liger_kernel.ops.swiglu import LigerSiLUMulFunction

from .._double_backward import refusing
from .._fallback import registered
from ._glu import private

# what this impl does not take goes to the torch impl, resolved by name on first use (polykernel.backends._fallback)
_torch_swiglu = registered("activation.swiglu")

# create_graph=True: second derivatives raise, naming the op, instead of reading zeros (refusing())
_SiLUMul = refusing(LigerSiLUMulFunction, "activation.swiglu", "liger", (0, 1))


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if gate.numel() == 0 or gate.dim() == 0:  # Liger indexes the last dim (IndexError on a 0-d tensor)
        return _torch_swiglu(gate, up)
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        gate, up = private(gate), private(up)
    return _SiLUMul.apply(gate, up)
