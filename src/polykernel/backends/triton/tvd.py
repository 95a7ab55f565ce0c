"""Triton total variation distance: forward and backward, any V, fp32 math, no host sync.

One kernel, one program per row, one pass over the row in BLOCK-wide chunks; constexpr flags
pick what it computes:
- LOSS_MODE 1: the row's sum of ``0.5·|p - q|`` into ``LOSS[row]``; 2: the elementwise loss into
  ``LOSS [rows, V]`` (reduction "none"); 0: none. Ignored rows give 0 (and load nothing).
- GRAD_P / GRAD_Q: ``±0.5·sign(p - q)·c`` with c read from device memory (the reduction's
  1/divisor: no host sync) or, with COT_ELEM, the elementwise cotangent.

For a scalar reduction the registered impl writes the gradients in the forward, so fwd+bwd
reads p and q once and writes dp once (3·N·V·elt bytes); the backward multiplies by the
cotangent (nothing when it is 1; on the device under CUDA-graph capture). With "none" the
backward runs the kernel again with the elementwise cotangent.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...ops._distill import acc_dtype
from ...ops.tvd import reference  # noqa: F401  (semantics live in the op file)
from .._jsd import count_and_scale
from .._tvd import divide, graph_grads
from ._autograd import lean_apply
from ._distill import config
from ._launch import launch
from ._rows import as_rows
from ._scale import scale_grads_

# ---------------------------------------------------------------------------------------------
# Kernel


@triton.jit
def _tvd_kernel(
    P,
    Q,
    LABELS,
    LOSS,
    DP,
    DQ,
    SCALE,
    V,
    stride_p,
    stride_q,
    stride_loss,
    stride_dp,
    stride_dq,
    stride_cot,
    ignore_index,
    BLOCK: tl.constexpr,
    HAS_LABELS: tl.constexpr,
    LOSS_MODE: tl.constexpr,
    GRAD_P: tl.constexpr,
    GRAD_Q: tl.constexpr,
    COT_ELEM: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    if HAS_LABELS:
        valid = tl.load(LABELS + row) != ignore_index
    else:
        valid = row >= 0
    n_load = tl.where(valid, V, 0)  # ignored rows read nothing
    if (GRAD_P or GRAD_Q) and not COT_ELEM:
        c = tl.where(valid, tl.load(SCALE).to(tl.float32), 0.0)  # 0 even when the scale is inf
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, V, BLOCK):
        offs = start + cols
        mask = offs < n_load
        p = tl.load(P + row * stride_p + offs, mask=mask, other=0.0).to(tl.float32)
        q = tl.load(Q + row * stride_q + offs, mask=mask, other=0.0).to(tl.float32)
        d = p - q
        if LOSS_MODE == 1:
            acc += 0.5 * tl.abs(d)
        if LOSS_MODE == 2:
            tl.store(LOSS + row * stride_loss + offs, 0.5 * tl.abs(d), mask=offs < V)
        if GRAD_P or GRAD_Q:
            if COT_ELEM:
                c = tl.load(SCALE + row * stride_cot + offs, mask=mask, other=0.0).to(tl.float32)
            half = 0.5 * c
            # sign(d): 0 where p == q (and where the row is ignored: d = 0 there), and 0 at NaN as
            # torch.sign (the reference's abs backward; the loss itself is NaN there)
            g = tl.where(d > 0, half, tl.where(d < 0, -half, 0.0))
            if GRAD_P:
                tl.store(DP + row * stride_dp + offs, g.to(DP.dtype.element_ty), mask=offs < V)
            if GRAD_Q:
                tl.store(DQ + row * stride_dq + offs, (-g).to(DQ.dtype.element_ty), mask=offs < V)
    if LOSS_MODE == 1:
        tl.store(LOSS + row, tl.sum(acc, axis=0))


# ---------------------------------------------------------------------------------------------
# Host launcher


def tvd_rows(p2, q2, labels, ignore_index, loss_mode, dp=None, dq=None, scale=None, cot=None):
    """Run the kernel on ``p2``, ``q2 [rows, V]`` (unit column stride); ``labels`` None or int
    [rows]. ``loss_mode`` 1: returns the per-row sums (fp32 [rows]); 2: the elementwise loss
    (fp32 [rows, V]); 0: None. Writes gradients into ``dp``/``dq`` ([rows, V], unit column
    stride) times ``scale`` (a 1-element fp32 device tensor) or the elementwise ``cot``."""
    rows, v = p2.shape
    if loss_mode == 1:
        loss = torch.empty(rows, dtype=torch.float32, device=p2.device)
    elif loss_mode == 2:
        loss = torch.empty((rows, v), dtype=torch.float32, device=p2.device)
    else:
        loss = None
    if rows == 0:
        return loss
    block, warps = config(v, max(p2.element_size(), q2.element_size()))
    src = cot if cot is not None else scale
    launch(
        _tvd_kernel, (rows,),
        p2, q2, p2 if labels is None else labels, p2 if loss is None else loss, p2 if dp is None else dp, p2 if dq is None else dq,
        p2 if src is None else src,
        v, p2.stride(0), q2.stride(0), 0 if loss is None or loss_mode == 1 else loss.stride(0),
        0 if dp is None else dp.stride(0), 0 if dq is None else dq.stride(0), 0 if cot is None else cot.stride(0),
        ignore_index,
        BLOCK=block, HAS_LABELS=labels is not None, LOSS_MODE=loss_mode, GRAD_P=dp is not None, GRAD_Q=dq is not None,
        COT_ELEM=cot is not None, num_warps=warps,
    )  # fmt: skip
    return loss


def _empty_like_rows(t2: torch.Tensor) -> torch.Tensor:
    return torch.empty(t2.shape, dtype=t2.dtype, device=t2.device)


def _flat_labels(labels: torch.Tensor | None) -> torch.Tensor | None:
    return None if labels is None else labels.reshape(-1).contiguous()


def _scale_tensor(c, device: torch.device) -> torch.Tensor:
    """The gradients' factor as a 1-element fp32 device tensor (no sync: a tensor stays one)."""
    return c.reshape(1).float() if isinstance(c, torch.Tensor) else torch.full((1,), c, dtype=torch.float32, device=device)


# ---------------------------------------------------------------------------------------------
# Registered impl


class _TVD(torch.autograd.Function):
    @staticmethod
    def forward(ctx, p, q, labels, reduction, ignore_index):  # type: ignore[override]
        v = p.shape[-1]
        p2, q2 = as_rows(p, v), as_rows(q, v)
        lab = _flat_labels(labels)
        need_p, need_q = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ctx.meta = (p.shape, q.shape, reduction, ignore_index, need_p, need_q)
        ctx.grads = None
        if reduction == "none":
            ctx.save_for_backward(p2, q2, lab)
            return tvd_rows(p2, q2, lab, ignore_index, 2).view(p.shape)
        _, count, _ = count_and_scale(lab, ignore_index, p2.shape[0], torch.float32, p2.device)
        div, c = divide(reduction, count, v)
        dp = _empty_like_rows(p2) if need_p else None
        dq = _empty_like_rows(q2) if need_q else None
        rows = tvd_rows(p2, q2, lab, ignore_index, 1, dp, dq, scale=_scale_tensor(c, p2.device))
        ctx.grads = (dp, dq)
        return rows.sum() / div

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        p_shape, q_shape, reduction, ignore_index, need_p, need_q = ctx.meta
        if reduction == "none":
            p2, q2, lab = ctx.saved_tensors
            if torch.is_grad_enabled():  # create_graph=True: differentiable gradients, by the torch formula
                valid = None if lab is None else lab != ignore_index
                dp, dq = graph_grads(p2, q2, valid, acc_dtype(p2, q2), g, need_p, need_q)
                return (None if dp is None else dp.view(p_shape)), (None if dq is None else dq.view(q_shape)), None, None, None
            dp = _empty_like_rows(p2) if need_p else None
            dq = _empty_like_rows(q2) if need_q else None
            tvd_rows(p2, q2, lab, ignore_index, 0, dp, dq, cot=as_rows(g.float(), p_shape[-1]))
        else:
            if ctx.grads is None:
                raise RuntimeError("polykernel tvd (triton): backward ran twice; the gradients were computed in the forward and consumed")
            (dp, dq) = ctx.grads  # consumed by a plain backward (a create_graph one may run again: retain_graph)
            if torch.is_grad_enabled():  # create_graph=True: differentiable gradients, by the torch formula
                dp, dq = graph_grads(None, None, None, None, g, need_p, need_q, unit=(dp, dq))
            else:
                ctx.grads = None
                scale_grads_(g, dp, dq)
        return (None if dp is None else dp.view(p_shape)), (None if dq is None else dq.view(q_shape)), None, None, None


_lean_apply = lean_apply(_TVD)  # _TVD.apply without its Python wrapper (see _autograd.py)


def tvd(p: torch.Tensor, q: torch.Tensor, labels: torch.Tensor | None, reduction: str, ignore_index: int) -> torch.Tensor:
    """The registered impl (arguments already validated by ``polykernel.tvd``)."""
    if torch.is_grad_enabled() and (p.requires_grad or q.requires_grad):
        return _lean_apply(p, q, labels, reduction, ignore_index)
    v = p.shape[-1]
    p2, q2 = as_rows(p, v), as_rows(q, v)
    lab = _flat_labels(labels)
    if reduction == "none":
        return tvd_rows(p2, q2, lab, ignore_index, 2).view(p.shape)
    _, count, _ = count_and_scale(lab, ignore_index, p2.shape[0], torch.float32, p2.device)
    return (tvd_rows(p2, q2, lab, ignore_index, 1).sum() / divide(reduction, count, v)[0]).to(acc_dtype(p, q))
