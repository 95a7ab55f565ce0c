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
from .. import _double_backward
from .._cross_entropy import TEMP_BYTES, scale_grads_


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


def graph_grads(saved, x2, t2, acc, reduction, log_target, g, needs, shape, unit=None) -> tuple:
    """The create_graph backward's (d_input, d_target), differentiable. With a target gradient
    (``needs[1]``): the reference's, through ``saved`` = (input, target), the Function's inputs.
    Else d_input = -t·g (-exp(t)·g), constant in input and linear in the cotangent ``g``: the
    forward's gradient for a unit cotangent (``unit``, a scalar reduction) times g, or, for
    "none", the formula on the saved rows ``x2``, ``t2`` times the elementwise g."""
    if needs[1]:
        return tuple(_double_backward.graph_grads(reference, (*saved, reduction, log_target), (g,), (*needs, False, False))[:2])
    if unit is not None:
        gx = unit[0] * g
    else:
        gx, _ = _grads(x2.detach().to(acc), t2.detach().to(acc), g.reshape(x2.shape).to(acc), log_target, True, False)
        gx = gx.to(x2.dtype)
    return gx.view(shape), None


class _KLDiv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, target, reduction, log_target):  # type: ignore[override]
        x2, t2 = rows_view(input), rows_view(target)
        acc = acc_dtype(input, target)
        need_x, need_t = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ctx.meta = (input.shape, reduction, log_target, acc, need_x, need_t)
        # the inputs as well (references) when target needs a gradient: a create_graph backward
        # then differentiates through both (see graph_grads)
        inputs = (input, target) if need_t else ()
        if reduction == "none":
            out, _, _ = _walk(x2, t2, acc, log_target, reduction, 1.0, False, False)
            ctx.save_for_backward(x2, t2, *inputs)
            return out.view(input.shape)
        if inputs:
            ctx.save_for_backward(*inputs)
        div = divisor(input, reduction)
        total, gx, gt = _walk(x2, t2, acc, log_target, reduction, 1.0 / div if div else float("inf"), need_x, need_t)
        ctx.grads = (gx, gt)
        return _finish(total, div)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        shape, reduction, log_target, acc, need_x, need_t = ctx.meta
        if reduction == "none":
            x2, t2, *inputs = ctx.saved_tensors
            if torch.is_grad_enabled():  # create_graph=True: differentiable gradients (see graph_grads)
                return (*graph_grads(inputs, x2, t2, acc, reduction, log_target, g, (need_x, need_t), shape), None, None)
            _, gx, gt = _walk(x2, t2, acc, log_target, reduction, None, need_x, need_t, cot=g.reshape(x2.shape))
        else:
            if ctx.grads is None:
                raise RuntimeError("polykernel kl_div (torch): backward ran twice; the gradients were computed in the forward and consumed")
            (gx, gt) = ctx.grads  # consumed by a plain backward (a create_graph one may run again: retain_graph)
            if torch.is_grad_enabled():  # create_graph=True: differentiable gradients (see graph_grads)
                unit = (gx, gt)
                return (
                    *graph_grads(ctx.saved_tensors, None, None, acc, reduction, log_target, g, (need_x, need_t), shape, unit),
                    None,
                    None,
                )
            ctx.grads = None
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
