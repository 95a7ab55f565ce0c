"""Liger-Kernel generalized JSD on ``loss.jsd``'s signature: Liger's own ``_jsd_kernel``.

Liger's ``LigerJSDFunction`` rounds the loss to the input's dtype and goes through Liger's
dispatcher; this adapter launches the kernel it runs (its whole computation) with a private
gradient buffer, and sums its fp32 per-element loss tile ([N, V] fp32: Liger's memory cost) in
fp32. Like Liger it counts the scored rows on the host (one sync per call: not capturable in a
CUDA graph). Where the contract differs: an all-ignored batch is NaN here (Liger's is 0), and an
entry whose probability is 0 (a -inf log-prob) is NaN in Liger's kernel where the contract
says 0 (0·log 0): the op's parity cases with a masked vocabulary fail for this impl.
"""

from __future__ import annotations

import torch
from liger_kernel.ops.jsd import _jsd_kernel

from ...ops._distill import rows_view
from .._cross_entropy import scale_grads_
from .._double_backward import refusing
from .._fallback import registered

# what this impl does not take goes to the torch impl, resolved by name on first use (polykernel.backends._fallback)
_torch_jsd = registered("loss.jsd")

_BLOCK = 4096  # liger_kernel/ops/backends/_triton/jsd.py: _JSD_TRITON_BLOCK_SIZE


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else 1


def loss_and_grad(x2: torch.Tensor, y2: torch.Tensor, labels: torch.Tensor | None, beta: float, ignore_index: int):
    """(the mean loss, fp32; d loss / d x2 in x2's dtype) through Liger's kernel."""
    rows, v = x2.shape
    x2, y2 = x2.contiguous(), y2.contiguous()
    count = rows if labels is None else int((labels != ignore_index).sum().item())
    loss = torch.zeros((rows, v), dtype=torch.float32, device=x2.device)
    dx = torch.empty_like(x2)
    _jsd_kernel[(rows,)](
        X_ptr=x2,
        X_stride=x2.stride(-2),
        Y_ptr=y2,
        Y_stride=y2.stride(-2),
        loss_ptr=loss,
        loss_stride=loss.stride(-2),
        dX_ptr=dx,
        dX_stride=dx.stride(-2),
        label_ptr=x2 if labels is None else labels,
        beta=float(beta),
        n_non_ignore=max(count, 1),  # all ignored: every row returns before using it
        ignore_index=ignore_index,
        n_cols=v,
        BLOCK_SIZE=min(_BLOCK, _next_pow2(v)),
        HAS_LABEL=labels is not None,
    )
    out = loss.sum()
    return (out + float("nan") if count == 0 else out), dx


class _LigerJSDPlain(torch.autograd.Function):
    @staticmethod
    def forward(ctx, student_logp, teacher_logp, labels, beta, ignore_index):  # type: ignore[override]
        lab = None if labels is None else labels.reshape(-1).contiguous()
        loss, dx = loss_and_grad(rows_view(student_logp), rows_view(teacher_logp.detach()), lab, beta, ignore_index)
        ctx.dx, ctx.shape = dx, student_logp.shape
        return loss

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        dx, ctx.dx = ctx.dx, None
        if dx is None:
            raise RuntimeError("polykernel jsd (liger): backward ran twice; the gradient was computed in the forward and consumed")
        scale_grads_(g, dx)  # dx is ours (a private buffer): scaled in place
        return dx.view(ctx.shape), None, None, None, None


# create_graph=True: second derivatives raise, naming the op, instead of reading zeros (refusing())
_LigerJSD = refusing(_LigerJSDPlain, "loss.jsd", "liger", (0,), kept=False)


def jsd(
    student_logp: torch.Tensor, teacher_logp: torch.Tensor, labels: torch.Tensor | None, beta: float, ignore_index: int
) -> torch.Tensor:
    if student_logp.numel() == 0:
        return _torch_jsd(student_logp, teacher_logp, labels, beta, ignore_index)
    return _LigerJSD.apply(student_logp, teacher_logp, labels, float(beta), ignore_index)
