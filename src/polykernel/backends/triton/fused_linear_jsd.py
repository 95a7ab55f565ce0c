"""Triton fused linear JSD: the shared row-chunk driver with one Triton kernel per chunk.

Per chunk the fp32 logits of student and teacher come from torch matmuls (cuBLAS, fp32
output); one kernel, one program per row, makes three passes over the row's two logit rows:
1. the log-sum-exp of each (online max and sum of ``z / t``);
2. the JSD terms of ``x = z_s/t - lse_s`` and ``y = z_t/t - lse_t`` (``_distill.jsd_elem``):
   the row's loss and ``S = Σ dJSD/dx``;
3. the student's dlogits ``(dJSD/dx - exp(x)·S)·c/t`` (the chain rule through log_softmax; c =
   1/count of scored rows, read from device memory: no host sync), recomputed from the logits
   and written in the inputs' dtype (in place over the student's logits when that is fp32).
No other ``[chunk, V]`` temporary exists; an ignored row reads nothing and gets dlogits 0. The
gradient matmuls and the backward's cotangent multiply are the driver's
(``polykernel.backends._fused_linear_jsd``; the multiply reads the cotangent on the device
under CUDA-graph capture, ``_scale``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...ops.fused_linear_jsd import reference  # noqa: F401  (semantics live in the op file)
from .._fused_linear_jsd import run
from ._distill import config, jsd_elem
from ._launch import launch
from ._scale import scale_grads_
from .jsd import beta_mode

# ---------------------------------------------------------------------------------------------
# Kernel


@triton.jit
def _fused_jsd_kernel(
    ZS,
    ZT,
    LABELS,
    LOSS,
    DZ,
    SCALE,
    V,
    stride_zs,
    stride_zt,
    stride_dz,
    ignore_index,
    beta,
    inv_t,
    scale,
    BLOCK: tl.constexpr,
    BETA_MODE: tl.constexpr,
    HAS_LABELS: tl.constexpr,
    SCALE_PTR: tl.constexpr,
    GRAD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    zs_row = ZS + row * stride_zs
    zt_row = ZT + row * stride_zt
    if HAS_LABELS:
        valid = tl.load(LABELS + row) != ignore_index
    else:
        valid = row >= 0
    n_load = tl.where(valid, V, 0)  # ignored rows read nothing
    # pass 1: online log-sum-exp of both rows (scaled by 1/t)
    ms = float("-inf")
    ss = 0.0
    mt = float("-inf")
    st = 0.0
    for start in range(0, V, BLOCK):
        offs = start + cols
        mask = offs < n_load
        a = tl.load(zs_row + offs, mask=mask, other=float("-inf")) * inv_t
        b = tl.load(zt_row + offs, mask=mask, other=float("-inf")) * inv_t
        ms_new = tl.maximum(ms, tl.max(a, axis=0))
        mt_new = tl.maximum(mt, tl.max(b, axis=0))
        ms_safe = tl.where(ms_new == float("-inf"), 0.0, ms_new)
        mt_safe = tl.where(mt_new == float("-inf"), 0.0, mt_new)
        ss = ss * tl.exp(ms - ms_safe) + tl.sum(tl.exp(a - ms_safe), axis=0)
        st = st * tl.exp(mt - mt_safe) + tl.sum(tl.exp(b - mt_safe), axis=0)
        ms = ms_new
        mt = mt_new
    lse_s = tl.where(valid, ms + tl.log(tl.where(valid, ss, 1.0)), 0.0)
    lse_t = tl.where(valid, mt + tl.log(tl.where(valid, st, 1.0)), 0.0)
    # pass 2: the row's loss and S = Σ d/dx
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    sd = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, V, BLOCK):
        offs = start + cols
        mask = offs < n_load
        x = tl.load(zs_row + offs, mask=mask, other=0.0) * inv_t - lse_s
        y = tl.load(zt_row + offs, mask=mask, other=0.0) * inv_t - lse_t
        term, d = jsd_elem(x, y, beta, BETA_MODE)
        acc += tl.where(mask, term, 0.0)
        sd += tl.where(mask, d, 0.0)
    tl.store(LOSS + row, tl.sum(acc, axis=0))
    # pass 3: the dlogits, recomputed (reading the logits again beats a [chunk, V] buffer)
    if GRAD:
        s_sum = tl.sum(sd, axis=0)
        if SCALE_PTR:
            c = tl.load(SCALE).to(tl.float32)
        else:
            c = scale
        k = tl.where(valid, c, 0.0) * inv_t  # 0 even when the scale is inf (nothing scored)
        dz_row = DZ + row * stride_dz
        for start in range(0, V, BLOCK):
            offs = start + cols
            mask = offs < n_load
            x = tl.load(zs_row + offs, mask=mask, other=0.0) * inv_t - lse_s
            y = tl.load(zt_row + offs, mask=mask, other=0.0) * inv_t - lse_t
            term, d = jsd_elem(x, y, beta, BETA_MODE)
            g = tl.where(mask, (d - tl.exp(x) * s_sum) * k, 0.0)
            tl.store(dz_row + offs, g.to(DZ.dtype.element_ty), mask=offs < V)


# ---------------------------------------------------------------------------------------------
# Host launcher


def _chunk(zs, zt, labels, beta, ignore_index, inv_t, scale, dz) -> torch.Tensor:
    """Per-row losses (fp32) of one chunk of fp32 logits ``zs``, ``zt [rows, V]``; with ``dz``
    ([rows, V], unit column stride; may be ``zs``) the dlogits times ``scale``."""
    rows, v = zs.shape
    loss = torch.empty(rows, dtype=torch.float32, device=zs.device)
    if rows == 0:
        return loss
    block, warps = config(v, 4)
    scale_ptr = isinstance(scale, torch.Tensor)
    launch(
        _fused_jsd_kernel, (rows,),
        zs, zt, zs if labels is None else labels, loss, zs if dz is None else dz, scale if scale_ptr else loss,
        v, zs.stride(0), zt.stride(0), 0 if dz is None else dz.stride(0),
        ignore_index, float(beta), float(inv_t), 0.0 if scale is None or scale_ptr else float(scale),
        BLOCK=block, BETA_MODE=beta_mode(beta), HAS_LABELS=labels is not None, SCALE_PTR=scale_ptr, GRAD=dz is not None,
        num_warps=warps,
    )  # fmt: skip
    return loss


# ---------------------------------------------------------------------------------------------
# Registered impl


def fused_linear_jsd(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    labels: torch.Tensor | None,
    beta: float,
    ignore_index: int,
    temperature: float,
) -> torch.Tensor:
    """The registered impl (arguments already validated by ``polykernel.fused_linear_jsd``)."""
    return run(
        student_hidden, student_weight, teacher_hidden, teacher_weight, labels, float(beta), ignore_index, float(temperature), _chunk,
        scale_grads_, impl="triton",
    )  # fmt: skip
