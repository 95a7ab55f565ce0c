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
from .._cross_entropy import scale_grads_
from .._kl_div import _finish, _walk, graph_grads


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
