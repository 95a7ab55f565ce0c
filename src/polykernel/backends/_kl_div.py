"""Row-chunked kl_div math shared by every backend's impls (the torch impl's, and triton's graph gradients);
here, not in ``backends/torch``, so that no backend imports another (issue 36)."""

from __future__ import annotations

import torch

from ..ops.kl_div import reference  # the create_graph backward differentiates the op file's reference
from . import _double_backward
from ._cross_entropy import TEMP_BYTES


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
