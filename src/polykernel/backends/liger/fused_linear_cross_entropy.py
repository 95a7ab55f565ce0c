"""Liger-Kernel fused linear cross-entropy (``LigerFusedLinearCrossEntropyFunction``) on
``loss.fused_linear_cross_entropy``'s signature.

Liger computes the gradients during the forward, chunk by chunk; ``accum_dtype=float32`` keeps
its dW/db accumulation in fp32 (its default accumulates in the weight's dtype). Its loss is fp32.
It syncs with the host (``.item()``) every call: not capturable in a CUDA graph. A "mean" over
no target is NaN here, as in PyTorch (Liger returns 0). ``ce_weight``, ``softcap`` and
``z_loss`` (Liger's ``lse_square_scale``) go to Liger; weight with z_loss is excluded by the
predicate (Liger's z-loss is unweighted: ``backends/liger/cross_entropy.py``).
"""

from __future__ import annotations

import torch
from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

from .._double_backward import refusing
from .._fallback import registered

# what this impl does not take goes to the torch impl, resolved by name on first use (polykernel.backends._fallback)
_torch_impl = registered("loss.fused_linear_cross_entropy")

# create_graph=True: second derivatives raise, naming the op, instead of reading zeros (refusing())
_FusedLinearCrossEntropy = refusing(LigerFusedLinearCrossEntropyFunction, "loss.fused_linear_cross_entropy", "liger", (0, 1, 3), kept=False)


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    reduction: str,
    ce_weight: torch.Tensor | None = None,
    softcap: float | None = None,
    z_loss: float = 0.0,
) -> torch.Tensor:
    h = hidden.shape[-1]
    t = target.reshape(-1)
    # a weighted mean over weights summing to 0 (Liger: 0/0 gradients; PyTorch: zero ones), and
    # weight with z_loss (unweighted in Liger): torch's impl
    zero_wsum = ce_weight is not None and reduction == "mean" and not bool(ce_weight[t[t != ignore_index].long()].sum())
    if hidden.numel() == 0 or target.numel() == 0 or zero_wsum or (ce_weight is not None and z_loss):
        return _torch_impl(hidden, weight, target, bias, ignore_index, label_smoothing, reduction, ce_weight, softcap, z_loss)
    loss = _FusedLinearCrossEntropy.apply(
        hidden.reshape(-1, h),
        weight,
        t,
        bias,
        None if ce_weight is None else ce_weight.to(torch.float32),
        ignore_index,
        float(z_loss),  # lse_square_scale
        float(label_smoothing),
        reduction,
        softcap,
        False,  # return_z_loss
        torch.float32,  # accum_dtype
    )[0]
    if reduction == "none":
        return loss.view(target.shape)
    if reduction == "mean" and not bool((t != ignore_index).any()):
        return loss + float("nan")
    return loss
