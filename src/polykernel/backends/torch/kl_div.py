"""PyTorch KL divergence, row-chunked: fp32 temporaries are O(TEMP_BYTES), never O(N·V).

The forward walks the rows in chunks (upcast, the elementwise loss, its sum) and, for a scalar
reduction, writes the gradients for a unit cotangent as it goes (they do not depend on the
cotangent but through one factor); the backward multiplies them by it. With ``"none"`` the
cotangent is per element: the backward walks the rows again.
"""

from __future__ import annotations

import torch

from ...ops._distill import acc_dtype, plain, rows_view
from ...ops.kl_div import divisor, reference  # (reference: the semantics live in the op file)
from .cross_entropy import TEMP_BYTES, scale_grads_


def _step(v: int) -> int:
    return max(1, TEMP_BYTES // (4 * max(v, 1)))


def _loss(x: torch.Tensor, t: torch.Tensor, log_target: bool) -> torch.Tensor:
    return t.exp() * (t - x) if log_target else torch.xlogy(t, t) - t * x


def _grads(x, t, c, log_target: bool, need_x: bool, need_t: bool):
    """(d_input, d_target) of one chunk for the cotangent factor ``c`` (a number or a chunk of
    the elementwise cotangent), as torch's autograd of the formula gives them."""
    gx = gt = None
    if log_target:
        e = t.exp()
        if need_x:
            gx = -e * c
        if need_t:
            gt = e * (t - x + 1.0) * c
    else:
        if need_x:
            gx = -t * c
        if need_t:  # d/dt [xlogy(t, t) - t·x]: torch's xlogy backward, NaN at t == 0 as there
            gt = torch.where(t == 0, 0.0, torch.xlogy(c, t)) + c * (t / t) - c * x
    return gx, gt


def _walk(x2, t2, acc, log_target, reduction, c, need_x, need_t, cot=None):
    """One pass over the row chunks: the loss (summed, or elementwise for "none") and, when
    asked, the gradients scaled by ``c`` (or by the elementwise ``cot``)."""
    n, v = x2.shape
    none = reduction == "none"
    out = torch.empty((n, v), dtype=acc, device=x2.device) if none and cot is None else None
    total = torch.zeros((), dtype=acc, device=x2.device)
    gx = torch.empty_like(x2, memory_format=torch.contiguous_format) if need_x else None
    gt = torch.empty_like(t2, memory_format=torch.contiguous_format) if need_t else None
    step = _step(v)
    for s in range(0, n, step):
        e = min(n, s + step)
        xf, tf = x2[s:e].to(acc), t2[s:e].to(acc)
        if cot is None:
            loss = _loss(xf, tf, log_target)
            if out is not None:
                out[s:e] = loss
            else:
                total += loss.sum()
        if need_x or need_t:
            a, b = _grads(xf, tf, c if cot is None else cot[s:e].to(acc), log_target, need_x, need_t)
            if a is not None:
                gx[s:e] = a  # type: ignore[index]
            if b is not None:
                gt[s:e] = b  # type: ignore[index]
    return (out if out is not None else total), gx, gt


def _finish(total: torch.Tensor, div: int) -> torch.Tensor:
    return total / div  # 0/0 = NaN: an empty "mean" (or "batchmean" of size(0) = 0), as PyTorch


class _KLDiv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, target, reduction, log_target):  # type: ignore[override]
        x2, t2 = rows_view(input), rows_view(target)
        acc = acc_dtype(input, target)
        need_x, need_t = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ctx.meta = (input.shape, reduction, log_target, acc, need_x, need_t)
        if reduction == "none":
            out, _, _ = _walk(x2, t2, acc, log_target, reduction, 1.0, False, False)
            ctx.save_for_backward(x2, t2)
            return out.view(input.shape)
        div = divisor(input, reduction)
        total, gx, gt = _walk(x2, t2, acc, log_target, reduction, 1.0 / div if div else float("inf"), need_x, need_t)
        ctx.grads = (gx, gt)
        return _finish(total, div)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        shape, reduction, log_target, acc, need_x, need_t = ctx.meta
        if reduction == "none":
            x2, t2 = ctx.saved_tensors
            _, gx, gt = _walk(x2, t2, acc, log_target, reduction, None, need_x, need_t, cot=g.reshape(x2.shape))
        else:
            if ctx.grads is None:
                raise RuntimeError("polykernel kl_div (torch): backward ran twice; the gradients were computed in the forward and consumed")
            (gx, gt), ctx.grads = ctx.grads, None
            scale_grads_(g, gx, gt)
        return (None if gx is None else gx.view(shape)), (None if gt is None else gt.view(shape)), None, None


def kl_div(input: torch.Tensor, target: torch.Tensor, reduction: str, log_target: bool) -> torch.Tensor:
    """The registered impl (arguments already validated by ``polykernel.kl_div``)."""
    if not plain(input, target):  # a subclass: the reference's torch ops (and autograd)
        return reference(input, target, reduction, log_target)
    if torch.is_grad_enabled() and (input.requires_grad or target.requires_grad):
        return _KLDiv.apply(input, target, reduction, log_target)
    acc = acc_dtype(input, target)
    out, _, _ = _walk(rows_view(input), rows_view(target), acc, log_target, reduction, 1.0, False, False)
    return out.view(input.shape) if reduction == "none" else _finish(out, divisor(input, reduction))
