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
from .._cross_entropy import TEMP_BYTES, scale_grads_
from .._double_backward import graph_grads


def _step(v: int) -> int:
    return max(1, TEMP_BYTES // (4 * max(v, 1)))


def terms(x: torch.Tensor, y: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(term, d term / dx) per element of student log-probs ``x`` and teacher log-probs ``y``
    (fp32 or fp64 ``[rows, V]``): the op's terms in closed form (a probability of 0 adds 0)."""
    if beta == 0:
        p = y.exp()
        return torch.where(p == 0, 0.0, p * (y - x)), -p
    if beta == 1:
        q = x.exp()
        term = torch.where(q == 0, 0.0, q * (x - y))
        return term, torch.where(q == 0, 0.0, term + q)
    p, q = y.exp(), x.exp()
    m = torch.maximum(x, y)
    m = torch.where(m == float("-inf"), 0.0, m)  # both -inf: any finite shift (both terms are 0)
    log_m = m + torch.log(beta * (y - m).exp() + (1.0 - beta) * (x - m).exp())
    tq = torch.where(q == 0, 0.0, (1.0 - beta) * q * (x - log_m))
    return torch.where(p == 0, 0.0, beta * p * (y - log_m)) + tq, tq


def count_and_scale(labels: torch.Tensor | None, ignore_index: int, rows: int, acc: torch.dtype, device: torch.device):
    """(valid [rows] bool or None, the count of scored rows, 1/count): tensors on the device when
    there are labels (no host sync), numbers otherwise. 1/0 is inf: the ignored rows' gradients
    are masked to 0, and the mean is 0/0 = NaN."""
    if labels is None:
        return None, rows, (1.0 / rows if rows else float("inf"))
    valid = labels.reshape(-1) != ignore_index
    count = valid.sum()
    return valid, count, torch.reciprocal(count.to(acc))


def _walk(x2, y2, valid, beta, scale, acc, grad: bool):
    """Row sums (masked to the scored rows) and, with ``grad``, the scaled gradient."""
    n, v = x2.shape
    rows = torch.empty(n, dtype=acc, device=x2.device)
    dx = torch.empty(x2.shape, dtype=x2.dtype, device=x2.device) if grad else None
    step = _step(v)
    for s in range(0, n, step):
        e = min(n, s + step)
        term, d = terms(x2[s:e].to(acc), y2[s:e].to(acc), beta)
        r = term.sum(-1)
        ok = None if valid is None else valid[s:e]
        rows[s:e] = r if ok is None else torch.where(ok, r, 0.0)
        if dx is not None:
            c = scale if ok is None else torch.where(ok, scale, 0.0)[:, None]  # ignored rows: 0 (never inf·0)
            dx[s:e] = torch.where(c == 0, 0.0, d * c) if ok is not None else d * c
    return rows, dx


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
