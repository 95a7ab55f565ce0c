"""Liger-Kernel fused add + RMSNorm (``LigerFusedAddRMSNormFunction``, "gemma" casting = our
fp32 math) on ``norm.fused_add_rms_norm``'s signature. s = x + residual is rounded to x's dtype
and normalized from that rounded value, as the op's contract has it."""

from __future__ import annotations

import torch
from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction

from .._double_backward import refusing
from .._fallback import registered

# what this impl does not take goes to the torch impl, resolved by name on first use (polykernel.backends._fallback)
_torch_impl = registered("norm.fused_add_rms_norm")

# create_graph=True: second derivatives raise, naming the op, instead of reading zeros (refusing())
_FusedAddRMSNorm = refusing(LigerFusedAddRMSNormFunction, "norm.fused_add_rms_norm", "liger", (0, 1, 2), kept=False)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if x.numel() == 0:
        return _torch_impl(x, residual, weight, eps, offset)
    y, s = _FusedAddRMSNorm.apply(x, residual, weight, eps, offset, "gemma", False)
    return y, s
