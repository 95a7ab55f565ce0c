"""PyTorch cross-entropy, row-chunked: fp32 temporaries are O(TEMP_BYTES), never O(N·V).

The registered impl; its row-chunked math (``loss_and_grad``, ``grad_from_lse``, ...) lives in
:mod:`polykernel.backends._cross_entropy`, shared with the other backends' loss impls.
"""

from __future__ import annotations

import torch

from ... import _compat
from ...ops.cross_entropy import reference  # noqa: F401  (semantics live in the op file)
from ...spec import Split
from .._cross_entropy import _acc, denominator, differentiable, extras, grad_from_lse, grad_scale, loss_and_grad, reduce_rows
from .._double_backward import graph_grads

_transforms_active = _compat.functorch_transforms_active


# ---------------------------------------------------------------------------------------------
# Registered impl


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ignore_index, ls, reduction, ex):  # type: ignore[override]
        v = logits.shape[-1]
        t = target.reshape(-1).long()
        loss, lse = loss_and_grad(logits.reshape(-1, v), t, ignore_index, ls, ex=ex)
        count = denominator(t, ignore_index, ex.weight, lse.dtype)
        # logits itself (not its [rows, V] view made here): a create_graph backward needs its graph
        ctx.save_for_backward(logits, target, t, lse, count)
        ctx.ignore_index, ctx.ls, ctx.reduction, ctx.ex = ignore_index, ls, reduction, ex
        return reduce_rows(loss, count, reduction, target.shape)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        logits, target, t, lse, count = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: a differentiable gradient
            args = (logits, target, ctx.ignore_index, ctx.ls, ctx.reduction, *ctx.ex)
            return graph_grads(differentiable, args, (g,), (True,) + (False,) * 7)[0], None, None, None, None, None
        scale = grad_scale(g, count, ctx.reduction, lse.dtype)
        dx = grad_from_lse(logits.reshape(-1, logits.shape[-1]), t, lse, scale, ctx.ignore_index, ctx.ls, ctx.ex)
        return dx.view(logits.shape), None, None, None, None, None


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    reduction: str,
    weight: torch.Tensor | None = None,
    softcap: float | None = None,
    z_loss: float = 0.0,
) -> torch.Tensor:
    """The registered impl (arguments already validated by ``polykernel.cross_entropy``)."""
    if _transforms_active():  # functorch (grad, vmap): plain torch ops, which its transforms take
        return differentiable(logits, target, ignore_index, label_smoothing, reduction, weight, softcap, z_loss)
    ex = extras(weight, softcap, z_loss)
    if torch.is_grad_enabled() and logits.requires_grad:
        return _CrossEntropy.apply(logits, target, ignore_index, label_smoothing, reduction, ex)
    v = logits.shape[-1]
    t = target.reshape(-1).long()
    loss, lse = loss_and_grad(logits.reshape(-1, v), t, ignore_index, label_smoothing, ex=ex)
    return reduce_rows(loss, denominator(t, ignore_index, weight, lse.dtype), reduction, target.shape)


# Forward and backward as separate functions, for compiled graphs (polykernel.compile.library). This
# split defines the op's saved layout, which every impl's split follows: the per-row LSE ([rows],
# fp32; fp64 for fp64 logits) and the non-ignored count (0-d int64); the target is an argument.
# With class weights a mean's divisor is their sum over the scored targets, recomputed from the
# arguments where needed (O(rows)), so the layout stays the same.
def _split_forward(logits, target, ignore_index, label_smoothing, reduction, weight, softcap, z_loss, grad_mask):
    t = target.reshape(-1).long()
    ex = extras(weight, softcap, z_loss)
    loss, lse = loss_and_grad(logits.reshape(-1, logits.shape[-1]), t, ignore_index, label_smoothing, ex=ex)
    count = (t != ignore_index).sum()
    den = count if weight is None else denominator(t, ignore_index, weight, lse.dtype)
    return (reduce_rows(loss, den, reduction, target.shape),), (lse, count)


def _split_backward(grads, saved, logits, target, ignore_index, label_smoothing, reduction, weight, softcap, z_loss, grad_mask):
    lse, count = saved
    t = target.reshape(-1).long()
    den = count if weight is None else denominator(t, ignore_index, weight, lse.dtype)
    scale = grad_scale(grads[0], den, reduction, lse.dtype)
    ex = extras(weight, softcap, z_loss)
    dx = grad_from_lse(logits.reshape(-1, logits.shape[-1]), t, lse, scale, ignore_index, label_smoothing, ex)
    return [dx.view(logits.shape), None, None, None, None, None, None, None]


def _split_layout(logits, target, ignore_index, label_smoothing, reduction, weight, softcap, z_loss, grad_mask):
    # For fake tensors: the forward's row loop would branch on the (symbolic) row count.
    rows = target.numel()
    return (torch.empty(rows, dtype=_acc(logits.dtype), device=logits.device), torch.empty((), dtype=torch.int64, device=logits.device))


cross_entropy.split = Split(forward=_split_forward, backward=_split_backward, layout=_split_layout)  # type: ignore[attr-defined]
