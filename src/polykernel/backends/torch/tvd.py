"""PyTorch total variation distance, row-chunked: fp32 temporaries are O(TEMP_BYTES).

The forward walks the rows in chunks: ``0.5·|p - q|`` (summed, or kept elementwise for "none")
and, for a scalar reduction, the gradients ``±0.5·sign(p - q)·c`` with c the reduction's
1/divisor (a device tensor when there are labels: no host sync); the backward multiplies them by
the cotangent. With "none" the cotangent is per element: the backward walks the rows again.
"""

from __future__ import annotations

import torch

from ...ops._distill import acc_dtype, plain, rows_view
from ...ops.tvd import reference  # (semantics live in the op file)
from .._cross_entropy import scale_grads_
from .._jsd import count_and_scale
from .._tvd import _walk, divide, graph_grads


class _TVD(torch.autograd.Function):
    @staticmethod
    def forward(ctx, p, q, labels, reduction, ignore_index):  # type: ignore[override]
        acc = acc_dtype(p, q)
        p2, q2 = rows_view(p), rows_view(q)
        valid, count, _ = count_and_scale(labels, ignore_index, p2.shape[0], acc, p2.device)
        need_p, need_q = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ctx.meta = (p.shape, q.shape, reduction, acc, need_p, need_q)
        ctx.grads = None
        if reduction == "none":
            out, _, _ = _walk(p2, q2, valid, acc, reduction, 1.0, False, False)
            ctx.save_for_backward(p2, q2, valid)
            return out.view(p.shape)
        div, c = divide(reduction, count, p2.shape[1], acc)
        total, gp, gq = _walk(p2, q2, valid, acc, reduction, c, need_p, need_q)
        ctx.grads = (gp, gq)
        return total / div

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        p_shape, q_shape, reduction, acc, need_p, need_q = ctx.meta
        if reduction == "none":
            p2, q2, valid = ctx.saved_tensors
            if torch.is_grad_enabled():  # create_graph=True: differentiable gradients (see graph_grads)
                gp, gq = graph_grads(p2, q2, valid, acc, g, need_p, need_q)
            else:
                _, gp, gq = _walk(p2, q2, valid, acc, reduction, None, need_p, need_q, cot=g.reshape(p2.shape))
        else:
            if ctx.grads is None:
                raise RuntimeError("polykernel tvd (torch): backward ran twice; the gradients were computed in the forward and consumed")
            (gp, gq) = ctx.grads  # consumed by a plain backward (a create_graph one may run again: retain_graph)
            if torch.is_grad_enabled():  # create_graph=True: differentiable gradients (see graph_grads)
                gp, gq = graph_grads(None, None, None, acc, g, need_p, need_q, unit=(gp, gq))
            else:
                ctx.grads = None
                scale_grads_(g, gp, gq)
        return (None if gp is None else gp.view(p_shape)), (None if gq is None else gq.view(q_shape)), None, None, None


def tvd(p: torch.Tensor, q: torch.Tensor, labels: torch.Tensor | None, reduction: str, ignore_index: int) -> torch.Tensor:
    """The registered impl (arguments already validated by ``polykernel.tvd``)."""
    if not plain(p, q, labels):  # a subclass: the reference's torch ops (and autograd)
        return reference(p, q, labels, reduction, ignore_index)
    if torch.is_grad_enabled() and (p.requires_grad or q.requires_grad):
        return _TVD.apply(p, q, labels, reduction, ignore_index)
    acc = acc_dtype(p, q)
    p2, q2 = rows_view(p), rows_view(q)
    valid, count, _ = count_and_scale(labels, ignore_index, p2.shape[0], acc, p2.device)
    out, _, _ = _walk(p2, q2, valid, acc, reduction, 1.0, False, False)
    return out.view(p.shape) if reduction == "none" else out / divide(reduction, count, p2.shape[1])[0]
