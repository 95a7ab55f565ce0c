"""Liger-Kernel KL divergence (``LigerKLDivLossFunction``) on ``loss.kl_div``'s signature.

Liger takes ``[BT, V]`` rows and divides "batchmean" by BT; PyTorch (our contract) divides by
input.size(0). So this adapter asks Liger for the "sum" (or "none") and divides here: autograd
passes 1/divisor to Liger's backward as its cotangent. Liger's loss is fp32; its log t is clamped
at eps = 1e-10 (a target below that is off by less than 1e-10·|log 1e-10|). It has no gradient for
target (the predicate refuses a target that needs one) and writes the input gradient in target's
dtype (refused unless it is input's). Its backward compares the cotangent with 1 on the host and
otherwise multiplies its 16-bit gradient by it in that dtype: a second rounding, so "batchmean"
and "mean" are refused in 16-bit (``_gates.kl_div``); a "sum" whose loss is scaled before the
backward rounds twice too, which no predicate can see (it reads no values).
"""

from __future__ import annotations

import torch
from liger_kernel.ops.kl_div import LigerKLDivLossFunction

from ...ops._distill import rows_view
from ...ops.kl_div import divisor
from .._double_backward import refusing
from .._fallback import registered

# what this impl does not take goes to the torch impl, resolved by name on first use (polykernel.backends._fallback)
_torch_kl_div = registered("loss.kl_div")

# create_graph=True: second derivatives raise, naming the op, instead of reading zeros (refusing())
_KLDivLoss = refusing(LigerKLDivLossFunction, "loss.kl_div", "liger", (0,), kept=False)


def kl_div(input: torch.Tensor, target: torch.Tensor, reduction: str, log_target: bool) -> torch.Tensor:
    if input.numel() == 0:
        return _torch_kl_div(input, target, reduction, log_target)
    x2, t2 = rows_view(input), rows_view(target)
    if reduction == "none":
        return _KLDivLoss.apply(x2, t2, "none", log_target, 1e-10).view(input.shape)
    return _KLDivLoss.apply(x2, t2, "sum", log_target, 1e-10) / divisor(input, reduction)
