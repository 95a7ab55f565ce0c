"""Liger-Kernel fused linear cross-entropy (``LigerFusedLinearCrossEntropyFunction``) on
``loss.fused_linear_cross_entropy``'s signature.

Liger computes the gradients during the forward, chunk by chunk; ``accum_dtype=float32`` keeps
its dW/db accumulation in fp32 (its default accumulates in the weight's dtype). Its loss is fp32.
It syncs with the host (``.item()``) every call: not capturable in a CUDA graph. A "mean" over
no target is NaN here, as in PyTorch (Liger returns 0).
"""

from __future__ import annotations

import torch
from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

from ..torch.fused_linear_cross_entropy import fused_linear_cross_entropy as _torch_impl


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    reduction: str,
) -> torch.Tensor:
    if hidden.numel() == 0 or target.numel() == 0:
        return _torch_impl(hidden, weight, target, bias, ignore_index, label_smoothing, reduction)
    h = hidden.shape[-1]
    t = target.reshape(-1)
    loss = LigerFusedLinearCrossEntropyFunction.apply(
        hidden.reshape(-1, h),
        weight,
        t,
        bias,
        None,  # ce_weight
        ignore_index,
        0.0,  # lse_square_scale
        float(label_smoothing),
        reduction,
        None,  # softcap
        False,  # return_z_loss
        torch.float32,  # accum_dtype
    )[0]
    if reduction == "none":
        return loss.view(target.shape)
    if reduction == "mean" and not bool((t != ignore_index).any()):
        return loss + float("nan")
    return loss
