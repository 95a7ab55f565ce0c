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
from .._cross_entropy import TEMP_BYTES, scale_grads_
from .jsd import count_and_scale


def _step(v: int) -> int:
    return max(1, TEMP_BYTES // (4 * max(v, 1)))


def divide(reduction: str, count, v: int, acc: torch.dtype = torch.float32):
    """(the loss's divisor, the gradients' 1/divisor): numbers or device tensors like count."""
    div = count * v if reduction == "mean" else count if reduction == "batchmean" else 1
    if isinstance(div, torch.Tensor):
        return div, torch.reciprocal(div.to(torch.float64)).to(acc)
    return div, (1.0 / div if div else float("inf"))


def _walk(p2, q2, valid, acc, reduction, c, need_p, need_q, cot=None):
    """One pass: the loss (summed, or elementwise for "none") and, when asked, the gradients
    times ``c`` (a number or 0-d tensor) or the elementwise ``cot``; ignored rows get 0."""
    n, v = p2.shape
    none = reduction == "none"
    out = torch.empty((n, v), dtype=acc, device=p2.device) if none and cot is None else None
    total = torch.zeros((), dtype=acc, device=p2.device)
    gp = torch.empty(p2.shape, dtype=p2.dtype, device=p2.device) if need_p else None
    gq = torch.empty(q2.shape, dtype=q2.dtype, device=q2.device) if need_q else None
    step = _step(v)
    for s in range(0, n, step):
        e = min(n, s + step)
        d = p2[s:e].to(acc) - q2[s:e].to(acc)
        ok = None if valid is None else valid[s:e, None]
        if cot is None:
            loss = 0.5 * d.abs()
            if ok is not None:
                loss = torch.where(ok, loss, 0.0)
            if out is not None:
                out[s:e] = loss
            else:
                total += loss.sum()
        if need_p or need_q:
            scale = c if cot is None else cot[s:e].to(acc)
            g = 0.5 * torch.sign(d) * scale
            if ok is not None:
                g = torch.where(ok, g, 0.0)
            if gp is not None:
                gp[s:e] = g
            if gq is not None:
                gq[s:e] = -g
    return (out if out is not None else total), gp, gq


def graph_grads(p2, q2, valid, acc, g, need_p: bool, need_q: bool, unit=None):
    """The create_graph backward's (dp, dq): ``±0.5·sign(p - q)·g`` (0 for ignored rows) with a
    graph to the cotangent ``g`` only, as the reference's: sign is constant almost everywhere, so
    its second derivative in p and q is 0. ``unit``: the forward's gradients for a unit scalar
    cotangent (a scalar reduction; p2, q2, valid are then unused), else ``g`` is elementwise."""
    if unit is not None:
        return tuple(None if u is None else u * g for u in unit)
    s = 0.5 * torch.sign(p2.detach().to(acc) - q2.detach().to(acc)) * g.reshape(p2.shape).to(acc)
    if valid is not None:
        s = torch.where(valid.reshape(-1, 1), s, 0.0)
    return (s.to(p2.dtype) if need_p else None), ((-s).to(q2.dtype) if need_q else None)


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
