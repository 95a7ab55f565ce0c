"""Triton generalized JSD: forward and backward, any V, fp32 math, no host sync.

One kernel, one program per row, one pass over the row in BLOCK-wide chunks: the per-element
terms and their derivative in the student's log-probs (``_distill.jsd_elem``), the row's sum into
``LOSS[row]`` and, with GRAD, the derivative times the scale (1/count of scored rows, read from
device memory, so no host sync) into ``DX``. An ignored row loads nothing and gets loss 0 and
gradient 0. The registered impl writes the gradient in the forward (the loss is a scalar: it
needs nothing else), so fwd+bwd reads both log-probs once and writes the gradient once
(3·N·V·elt bytes); the backward multiplies it by the cotangent (nothing when it is 1; on the
device under CUDA-graph capture).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...ops._distill import acc_dtype
from ...ops.jsd import OP_ID, reference  # noqa: F401  (reference: semantics live in the op file)
from .._double_backward import anchor, refuse
from .._jsd import count_and_scale
from ._autograd import lean_apply
from ._distill import config, jsd_elem
from ._launch import launch
from ._rows import as_rows
from ._scale import scale_grads_

# ---------------------------------------------------------------------------------------------
# Kernel


@triton.jit
def _jsd_kernel(
    X,
    Y,
    LABELS,
    LOSS,
    DX,
    SCALE,
    V,
    stride_x,
    stride_y,
    stride_dx,
    ignore_index,
    beta,
    scale,
    BLOCK: tl.constexpr,
    BETA_MODE: tl.constexpr,
    HAS_LABELS: tl.constexpr,
    SCALE_PTR: tl.constexpr,
    GRAD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    if HAS_LABELS:
        valid = tl.load(LABELS + row) != ignore_index
    else:
        valid = row >= 0
    n_load = tl.where(valid, V, 0)  # ignored rows read nothing
    if GRAD:
        if SCALE_PTR:
            c = tl.load(SCALE).to(tl.float32)
        else:
            c = scale
        c = tl.where(valid, c, 0.0)  # 0 even when the scale is inf (nothing scored)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, V, BLOCK):
        offs = start + cols
        mask = offs < n_load
        x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        y = tl.load(Y + row * stride_y + offs, mask=mask, other=0.0).to(tl.float32)
        term, dx = jsd_elem(x, y, beta, BETA_MODE)
        acc += tl.where(mask, term, 0.0)
        if GRAD:
            tl.store(DX + row * stride_dx + offs, tl.where(mask, dx * c, 0.0).to(DX.dtype.element_ty), mask=offs < V)
    tl.store(LOSS + row, tl.sum(acc, axis=0))


# ---------------------------------------------------------------------------------------------
# Host launcher


def beta_mode(beta: float) -> int:
    """The kernels' BETA_MODE: 0 forward KL, 1 reverse KL, 2 the generalized JSD."""
    return 0 if beta == 0 else 1 if beta == 1 else 2


def jsd_rows(x2, y2, labels, ignore_index, beta, dx=None, scale=None):
    """Per-row sums (fp32 [rows], 0 for ignored rows) of the JSD terms of ``x2``, ``y2 [rows, V]``
    (unit column stride); with ``dx`` ([rows, V], unit column stride) also the gradient times
    ``scale`` (a number or a 1-element device tensor). ``labels``: None or int [rows]."""
    rows, v = x2.shape
    loss = torch.empty(rows, dtype=torch.float32, device=x2.device)
    if rows == 0:
        return loss
    block, warps = config(v, max(x2.element_size(), y2.element_size()))
    scale_ptr = isinstance(scale, torch.Tensor)
    launch(
        _jsd_kernel, (rows,),
        x2, y2, x2 if labels is None else labels, loss, x2 if dx is None else dx, scale if scale_ptr else loss,
        v, x2.stride(0), y2.stride(0), 0 if dx is None else dx.stride(0),
        ignore_index, float(beta), 0.0 if scale is None or scale_ptr else float(scale),
        BLOCK=block, BETA_MODE=beta_mode(beta), HAS_LABELS=labels is not None, SCALE_PTR=scale_ptr, GRAD=dx is not None,
        num_warps=warps,
    )  # fmt: skip
    return loss


# ---------------------------------------------------------------------------------------------
# Registered impl


def _flat_labels(labels: torch.Tensor | None) -> torch.Tensor | None:
    return None if labels is None else labels.reshape(-1).contiguous()


class _JSD(torch.autograd.Function):
    @staticmethod
    def forward(ctx, student_logp, teacher_logp, labels, beta, ignore_index):  # type: ignore[override]
        v = student_logp.shape[-1]
        x2, y2 = as_rows(student_logp, v), as_rows(teacher_logp.detach(), v)
        lab = _flat_labels(labels)
        _, count, scale = count_and_scale(lab, ignore_index, x2.shape[0], torch.float32, x2.device)
        dx = torch.empty(x2.shape, dtype=x2.dtype, device=x2.device)
        rows = jsd_rows(x2, y2, lab, ignore_index, float(beta), dx, scale)
        ctx.dx, ctx.shape = dx, student_logp.shape
        with torch.enable_grad():  # a handle on the input's graph, for refuse(); the inputs are not kept
            ctx.save_for_backward(anchor(student_logp))
        return rows.sum() / count

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        dx, ctx.dx = ctx.dx, None
        if dx is None:
            raise RuntimeError("polykernel jsd (triton): backward ran twice; the gradient was computed in the forward and consumed")
        if torch.is_grad_enabled():  # create_graph=True: this gradient carries no graph
            dx = dx * g
            (dx,) = refuse(OP_ID, "triton", _WHY, (*ctx.saved_tensors, g if g.requires_grad else None), dx)
            return dx.view(ctx.shape), None, None, None, None
        scale_grads_(g, dx)
        return dx.view(ctx.shape), None, None, None, None


_WHY = 'the gradient is computed in the forward and the inputs are not kept; use impl="torch"'


_lean_apply = lean_apply(_JSD)  # _JSD.apply without its Python wrapper (see _autograd.py)


def jsd(
    student_logp: torch.Tensor, teacher_logp: torch.Tensor, labels: torch.Tensor | None, beta: float, ignore_index: int
) -> torch.Tensor:
    """The registered impl (arguments already validated by ``polykernel.jsd``)."""
    if torch.is_grad_enabled() and student_logp.requires_grad:
        return _lean_apply(student_logp, teacher_logp, labels, beta, ignore_index)
    v = student_logp.shape[-1]
    lab = _flat_labels(labels)
    rows = jsd_rows(as_rows(student_logp, v), as_rows(teacher_logp, v), lab, ignore_index, float(beta))
    count = rows.numel() if lab is None else (lab != ignore_index).sum()
    return (rows.sum() / count).to(acc_dtype(student_logp, teacher_logp))
