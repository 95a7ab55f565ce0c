"""PyTorch generalized JSD, row-chunked: fp32 temporaries are O(TEMP_BYTES), never O(N·V).

The forward walks the rows in chunks: the per-element terms and their closed-form derivative in
the student's log-probs (:func:`terms`, shared with the fused linear JSD), the row sums and, when
the student needs a gradient, that derivative divided by the count of scored rows, written in
the student's dtype. The backward multiplies it by the cotangent.
"""

from __future__ import annotations

import torch

from ...ops._distill import acc_dtype, plain, rows_view
from ...ops.jsd import reference  # (semantics live in the op file)
from .._cross_entropy import scale_grads_
from .._double_backward import graph_grads
from .._jsd import _walk, count_and_scale


class _JSD(torch.autograd.Function):
    @staticmethod
    def forward(ctx, student_logp, teacher_logp, labels, beta, ignore_index):  # type: ignore[override]
        acc = acc_dtype(student_logp, teacher_logp)
        x2, y2 = rows_view(student_logp), rows_view(teacher_logp.detach())
        valid, count, scale = count_and_scale(labels, ignore_index, x2.shape[0], acc, x2.device)
        rows, dx = _walk(x2, y2, valid, float(beta), scale, acc, True)
        ctx.dx, ctx.shape, ctx.options = dx, student_logp.shape, (float(beta), ignore_index)
        # the inputs (references, no copies) for a create_graph backward, which needs the teacher's
        # values; the Triton impl keeps none and refuses (its memory is Liger's)
        ctx.save_for_backward(student_logp, teacher_logp, labels)
        return rows.sum() / count

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        if torch.is_grad_enabled():  # create_graph=True: the reference's differentiable gradient
            s, t, labels = ctx.saved_tensors
            ds = graph_grads(reference, (s, t.detach(), labels, *ctx.options), (g,), (True, False, False, False, False))[0]
            return ds, None, None, None, None
        dx, ctx.dx = ctx.dx, None
        if dx is None:
            raise RuntimeError("polykernel jsd (torch): backward ran twice; the gradient was computed in the forward and consumed")
        scale_grads_(g, dx)
        return dx.view(ctx.shape), None, None, None, None


def jsd(
    student_logp: torch.Tensor, teacher_logp: torch.Tensor, labels: torch.Tensor | None, beta: float, ignore_index: int
) -> torch.Tensor:
    """The registered impl (arguments already validated by ``polykernel.jsd``)."""
    if not plain(student_logp, teacher_logp, labels):  # a subclass: the reference's torch ops (and autograd)
        return reference(student_logp, teacher_logp, labels, beta, ignore_index)
    if torch.is_grad_enabled() and student_logp.requires_grad:
        return _JSD.apply(student_logp, teacher_logp, labels, beta, ignore_index)
    acc = acc_dtype(student_logp, teacher_logp)
    x2, y2 = rows_view(student_logp), rows_view(teacher_logp)
    valid, count, scale = count_and_scale(labels, ignore_index, x2.shape[0], acc, x2.device)
    rows, _ = _walk(x2, y2, valid, float(beta), scale, acc, False)
    return rows.sum() / count
