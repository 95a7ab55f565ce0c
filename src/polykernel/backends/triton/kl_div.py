"""Triton KL divergence: forward and backward, any V, fp32 math.

One kernel, one program per row, one pass over the row in BLOCK-wide chunks; constexpr flags
pick what it computes:
- LOSS_MODE 1: the row's sum of ``t·(log t - x)`` (``exp(t)·(t - x)``) into ``LOSS[row]`` (fp32);
  2: the elementwise loss into ``LOSS [rows, V]`` (reduction "none"); 0: none.
- GRAD_X / GRAD_T: ``d_input = -t·c`` (``-exp(t)·c``) and ``d_target`` (torch's autograd of the
  formula), with ``c`` the host scalar ``scale`` or, with COT_ELEM, the elementwise cotangent.

For a scalar reduction the registered impl writes the gradients in the forward (c = 1/divisor:
they need nothing else), so fwd+bwd reads input and target once and writes d_input once
(3·N·V·elt bytes); the backward multiplies them by the cotangent (nothing when it is 1; on the
device under CUDA-graph capture). With "none" the backward runs the kernel again with the
elementwise cotangent.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...ops._distill import acc_dtype
from ...ops.kl_div import divisor, reference  # noqa: F401  (reference: the semantics live in the op file)
from .._kl_div import graph_grads
from ._autograd import lean_apply
from ._distill import config
from ._launch import launch
from ._rows import as_rows
from ._scale import scale_grads_

# ---------------------------------------------------------------------------------------------
# Kernel


@triton.jit
def _kl_div_kernel(
    X,
    T,
    LOSS,
    DX,
    DT,
    COT,
    V,
    stride_x,
    stride_t,
    stride_loss,
    stride_dx,
    stride_dt,
    stride_cot,
    scale,
    BLOCK: tl.constexpr,
    LOG_TARGET: tl.constexpr,
    LOSS_MODE: tl.constexpr,
    GRAD_X: tl.constexpr,
    GRAD_T: tl.constexpr,
    COT_ELEM: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, V, BLOCK):
        offs = start + cols
        mask = offs < V
        x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        t = tl.load(T + row * stride_t + offs, mask=mask, other=0.0).to(tl.float32)
        if LOG_TARGET:
            e = tl.exp(t)
            loss = e * (t - x)
        else:
            loss = tl.where(t == 0.0, 0.0, t * tl.log(t)) - t * x  # torch.xlogy(t, t) - t·x
        if LOSS_MODE == 1:
            acc += tl.where(mask, loss, 0.0)
        if LOSS_MODE == 2:
            tl.store(LOSS + row * stride_loss + offs, loss, mask=mask)
        if GRAD_X or GRAD_T:
            if COT_ELEM:
                c = tl.load(COT + row * stride_cot + offs, mask=mask, other=0.0).to(tl.float32)
            else:
                c = tl.zeros([BLOCK], dtype=tl.float32) + scale  # a block, so that `c == 0` is one too
            if GRAD_X:
                if LOG_TARGET:
                    gx = -e * c
                else:
                    gx = -t * c
                tl.store(DX + row * stride_dx + offs, gx.to(DX.dtype.element_ty), mask=mask)
            if GRAD_T:
                if LOG_TARGET:
                    gt = e * (t - x + 1.0) * c
                else:
                    # torch's xlogy backward: xlogy(c, t) masked where t == 0, plus c·t/t (NaN at
                    # t == 0), minus c·x
                    xl = tl.where((t == 0.0) | (c == 0.0), 0.0, c * tl.log(t))
                    gt = xl + c * (t / t) - c * x
                tl.store(DT + row * stride_dt + offs, gt.to(DT.dtype.element_ty), mask=mask)
    if LOSS_MODE == 1:
        tl.store(LOSS + row, tl.sum(acc, axis=0))


# ---------------------------------------------------------------------------------------------
# Host launcher


def kl_div_rows(x2, t2, log_target, loss_mode, dx=None, dt=None, scale=1.0, cot=None):
    """Run the kernel on ``x2``, ``t2 [rows, V]`` (unit column stride). ``loss_mode`` 1: returns
    the per-row sums (fp32 [rows]); 2: the elementwise loss (fp32 [rows, V]); 0: None. Writes the
    gradients into ``dx``/``dt`` (given, [rows, V], unit column stride) scaled by ``scale`` or
    the elementwise ``cot`` (fp32 [rows, V], unit column stride)."""
    rows, v = x2.shape
    if loss_mode == 1:
        loss = torch.empty(rows, dtype=torch.float32, device=x2.device)
    elif loss_mode == 2:
        loss = torch.empty((rows, v), dtype=torch.float32, device=x2.device)
    else:
        loss = None
    if rows == 0 or (v == 0 and loss_mode != 1):
        return loss
    block, warps = config(v, max(x2.element_size(), t2.element_size()))
    dummy = x2
    launch(
        _kl_div_kernel, (rows,),
        x2, t2, dummy if loss is None else loss, dummy if dx is None else dx, dummy if dt is None else dt, dummy if cot is None else cot,
        v, x2.stride(0), t2.stride(0), 0 if loss is None or loss_mode == 1 else loss.stride(0),
        0 if dx is None else dx.stride(0), 0 if dt is None else dt.stride(0), 0 if cot is None else cot.stride(0),
        float(scale),
        BLOCK=block, LOG_TARGET=log_target, LOSS_MODE=loss_mode, GRAD_X=dx is not None, GRAD_T=dt is not None,
        COT_ELEM=cot is not None, num_warps=warps,
    )  # fmt: skip
    return loss


def _empty_like_rows(t2: torch.Tensor) -> torch.Tensor:
    return torch.empty(t2.shape, dtype=t2.dtype, device=t2.device)


# ---------------------------------------------------------------------------------------------
# Registered impl


class _KLDiv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, target, reduction, log_target):  # type: ignore[override]
        v = input.shape[-1]
        x2, t2 = as_rows(input, v), as_rows(target, v)
        need_x, need_t = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ctx.meta = (input.shape, reduction, log_target, need_x, need_t)
        ctx.grads = None
        # the inputs as well (references) when target needs a gradient: a create_graph backward
        # then differentiates through both (torch.kl_div.graph_grads)
        inputs = (input, target) if need_t else ()
        if reduction == "none":
            ctx.save_for_backward(x2, t2, *inputs)
            return kl_div_rows(x2, t2, log_target, 2).view(input.shape)
        if inputs:
            ctx.save_for_backward(*inputs)
        div = divisor(input, reduction)
        dx = _empty_like_rows(x2) if need_x else None
        dt = _empty_like_rows(t2) if need_t else None
        rows = kl_div_rows(x2, t2, log_target, 1, dx, dt, scale=1.0 / div if div else float("inf"))
        ctx.grads = (dx, dt)
        return rows.sum() / div  # 0/0 = NaN: an empty "mean", as PyTorch

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        shape, reduction, log_target, need_x, need_t = ctx.meta
        if reduction == "none":
            x2, t2, *inputs = ctx.saved_tensors
            if torch.is_grad_enabled():  # create_graph=True: differentiable gradients, by the torch formula
                acc = acc_dtype(x2, t2)
                return (*graph_grads(inputs, x2, t2, acc, reduction, log_target, g, (need_x, need_t), shape), None, None)
            dx = _empty_like_rows(x2) if need_x else None
            dt = _empty_like_rows(t2) if need_t else None
            kl_div_rows(x2, t2, log_target, 0, dx, dt, cot=as_rows(g.float(), shape[-1]))
        else:
            if ctx.grads is None:
                raise RuntimeError(
                    "polykernel kl_div (triton): backward ran twice; the gradients were computed in the forward and consumed"
                )
            (dx, dt) = ctx.grads  # consumed by a plain backward (a create_graph one may run again: retain_graph)
            if torch.is_grad_enabled():  # create_graph=True: differentiable gradients, by the torch formula
                unit = (dx, dt)
                return (
                    *graph_grads(ctx.saved_tensors, None, None, None, reduction, log_target, g, (need_x, need_t), shape, unit),
                    None,
                    None,
                )
            ctx.grads = None
            scale_grads_(g, dx, dt)
        return (None if dx is None else dx.view(shape)), (None if dt is None else dt.view(shape)), None, None


_lean_apply = lean_apply(_KLDiv)  # _KLDiv.apply without its Python wrapper (see _autograd.py)


def kl_div(input: torch.Tensor, target: torch.Tensor, reduction: str, log_target: bool) -> torch.Tensor:
    """The registered impl (arguments already validated by ``polykernel.kl_div``)."""
    if torch.is_grad_enabled() and (input.requires_grad or target.requires_grad):
        return _lean_apply(input, target, reduction, log_target)
    v = input.shape[-1]
    x2, t2 = as_rows(input, v), as_rows(target, v)
    if reduction == "none":
        return kl_div_rows(x2, t2, log_target, 2).view(input.shape)
    out = kl_div_rows(x2, t2, log_target, 1).sum() / divisor(input, reduction)
    return out.to(acc_dtype(input, target))
