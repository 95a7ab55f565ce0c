"""Liger-Kernel fused linear JSD (``LigerFusedLinearJSDFunction``) on ``loss.fused_linear_jsd``'s
signature.

Liger computes the student's gradients during the forward, chunk by chunk; ``accum_dtype=float32``
keeps its dW accumulation in fp32 (its default accumulates in the weight's dtype). Its logits are
fp32 matmul outputs on CUDA (the contract's), rounded to the inputs' dtype first elsewhere. Its
loss is fp32. It syncs with the host (``.item()``) every call: not capturable in a CUDA graph.
An all-ignored batch is NaN here, as the contract says (Liger returns 0); an entry whose
probability is 0 gives NaN in Liger's JSD kernel (finite logits never do that).
"""

from __future__ import annotations

import torch
from liger_kernel.ops.fused_linear_jsd import LigerFusedLinearJSDFunction

from ...ops._distill import rows_view
from .._double_backward import refusing
from .._fallback import registered

# what this impl does not take goes to the torch impl, resolved by name on first use (polykernel.backends._fallback)
_torch_impl = registered("loss.fused_linear_jsd")

# create_graph=True: second derivatives raise, naming the op, instead of reading zeros (refusing())
_FusedLinearJSD = refusing(LigerFusedLinearJSDFunction, "loss.fused_linear_jsd", "liger", (0, 1), kept=False)


def fused_linear_jsd(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    labels: torch.Tensor | None,
    beta: float,
    ignore_index: int,
    temperature: float,
) -> torch.Tensor:
    lab = None if labels is None else labels.reshape(-1)
    if student_hidden.numel() == 0 or (lab is not None and not bool((lab != ignore_index).any())):
        return _torch_impl(student_hidden, student_weight, teacher_hidden, teacher_weight, labels, beta, ignore_index, temperature)
    return _FusedLinearJSD.apply(
        rows_view(student_hidden),
        student_weight,
        rows_view(teacher_hidden.detach()),
        teacher_weight.detach(),
        lab,
        float(beta),
        ignore_index,
        float(temperature),
        torch.float32,  # accum_dtype
        None,  # jsd_impl
        None,  # jsd_mode
    )
