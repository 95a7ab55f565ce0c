"""Triton DyT: ``weight·tanh(alpha·x) + bias``, forward and backward (dX, dalpha, dW, dB).

x is viewed as ``[M, N]`` rows (unit column stride, any row stride). Forward: one elementwise
pass, a ``[ROWS, BLOCK_N]`` tile per program over a (row blocks, column blocks) grid. Backward:
a grid of (P, column blocks) programs; program (p, j) walks row blocks p, p+P, ... of column
block j, writes dx and keeps its share of dW, dB (per column) and dalpha (one number) in
registers, stored to its own slot of fp32 partial buffers that the host sums in a fixed order:
no atomics, so the result is deterministic and the impl is registered ``deterministic=True``.

tanh is computed here to a few ulps (Triton has no portable tanh: libdevice's does not run on
the CPU interpreter): an odd Taylor polynomial for |z| < 0.4, else ``(1 - q)/(1 + q)`` with
``q = exp(-2|z|)``, whose ``1 - t² = 4q/(1 + q)²`` keeps the backward accurate where t -> ±1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...ops.dyt import reference
from .._double_backward import graph_grads
from .._fallback import registered
from ._autograd import lean_apply
from ._autograd import transforms_active as _transforms_active
from ._colsum import colsum as _colsum
from ._launch import launch
from ._rows import as_rows as _as_rows
from ._rows import cdiv as _cdiv
from ._rows import contig as _contig_t
from ._rows import next_pow2 as _next_pow2
from ._rows import sm_count as _sm_count
from ._rows import unrows as _unrows

# what this impl does not take goes to the torch impl, resolved by name on first use (polykernel.backends._fallback)
_torch_dyt = registered("norm.dyt")

TILE = 4096  # elements per program (ROWS · BLOCK_N)
MAX_BLOCK_N = 4096

# tanh(z) = z·(1 + z²·(c3 + z²·(c5 + ...))) for |z| < 0.4: the next term is < 1.1e-10·|z|
_C3 = tl.constexpr(-1 / 3)
_C5 = tl.constexpr(2 / 15)
_C7 = tl.constexpr(-17 / 315)
_C9 = tl.constexpr(62 / 2835)
_C11 = tl.constexpr(-1382 / 155925)
_C13 = tl.constexpr(21844 / 6081075)

# ---------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _tanh(z):
    """(tanh z, 1 - tanh² z) in fp32, each to a few ulps."""
    a = tl.abs(z)
    small = a < 0.4
    zs = tl.where(small, z, 0.0)  # the polynomial only where it is used (no overflow elsewhere)
    z2 = zs * zs
    p = zs * (z2 * (z2 * (z2 * (z2 * (z2 * (z2 * _C13 + _C11) + _C9) + _C7) + _C5) + _C3) + 1.0)
    q = tl.exp(-2.0 * a)  # in (0, 1]: no overflow
    big = (1.0 - q) / (1.0 + q)
    t = tl.where(small, p, tl.where(z < 0.0, -big, big))
    d = tl.where(small, 1.0 - p * p, 4.0 * q / ((1.0 + q) * (1.0 + q)))
    return t, d


@triton.jit
def _dyt_fwd_kernel(
    X, ALPHA, W, B, Y,
    M, N, stride_x, stride_y,
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr, HAS_B: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    mask = (rows < M)[:, None] & col_ok[None, :]
    a = tl.load(ALPHA).to(tl.float32)
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    t, _ = _tanh(x * a)
    y = t * tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_B:
        y = y + tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _dyt_bwd_kernel(
    X, ALPHA, W, DY, DX, DA_PART, DW_PART, DB_PART,
    M, N, stride_x, stride_dy, stride_dx,
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr, HAS_B: tl.constexpr,
):  # fmt: skip
    p = tl.program_id(0)
    progs = tl.num_programs(0)
    j = tl.program_id(1)
    cols = j * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    a = tl.load(ALPHA).to(tl.float32)
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    da = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    dw = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    if HAS_B:
        db = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    for block in range(p, tl.cdiv(M, ROWS), progs):
        rows = tl.cast(block, tl.int64) * ROWS + tl.arange(0, ROWS)
        mask = (rows < M)[:, None] & col_ok[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        t, d = _tanh(x * a)
        g = dy * w[None, :] * d  # 0 outside the mask (dy = 0 there)
        da += g * x
        dw += dy * t
        if HAS_B:
            db += dy
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], (g * a).to(DX.dtype.element_ty), mask=mask)
    part = tl.cast(p, tl.int64) * N + cols
    tl.store(DW_PART + part, tl.sum(dw, axis=0), mask=col_ok)
    if HAS_B:
        tl.store(DB_PART + part, tl.sum(db, axis=0), mask=col_ok)
    tl.store(DA_PART + tl.cast(p, tl.int64) * tl.num_programs(1) + j, tl.sum(tl.sum(da, axis=1), axis=0))


# ---------------------------------------------------------------------------------------------
# Host launchers

# Launch settings (a sweep may override them to measure alternatives).
TUNE = {"bwd_programs_per_sm": 2}  # programs of the backward over (row blocks, column blocks), per SM


def _tile(m: int, n: int) -> tuple[int, int, int]:
    """(BLOCK_N, ROWS, num_warps): about TILE elements per program."""
    block_n = min(MAX_BLOCK_N, _next_pow2(max(n, 1)))
    rows = min(max(1, TILE // block_n), _next_pow2(max(m, 1)))
    return block_n, rows, max(1, min(8, block_n * rows // 512))


def dyt_forward(x2: torch.Tensor, alpha: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """y [M, N] in x's dtype (weight, bias contiguous; alpha one element)."""
    m, n = x2.shape
    y = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    if m == 0 or n == 0:
        return y
    block_n, rows, warps = _tile(m, n)
    launch(
        _dyt_fwd_kernel, (_cdiv(m, rows), _cdiv(n, block_n)),
        x2, alpha, weight, bias if bias is not None else weight, y, m, n, x2.stride(0), y.stride(0),
        BLOCK_N=block_n, ROWS=rows, HAS_B=bias is not None, num_warps=warps,
    )  # fmt: skip
    return y


def dyt_backward(
    dy2: torch.Tensor, x2: torch.Tensor, alpha: torch.Tensor, weight: torch.Tensor, bias_dtype: torch.dtype | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(dx [M, N] in x's dtype, dalpha shaped and typed as alpha, dW [N] in weight's dtype, dB [N]
    in ``bias_dtype`` or None)."""
    m, n = x2.shape
    dev = x2.device
    dx = torch.empty((m, n), dtype=x2.dtype, device=dev)
    if m == 0 or n == 0:
        db = torch.zeros(n, dtype=bias_dtype, device=dev) if bias_dtype is not None else None
        return dx, torch.zeros_like(alpha), torch.zeros(n, dtype=weight.dtype, device=dev), db
    block_n, rows, warps = _tile(m, n)
    col_blocks = _cdiv(n, block_n)
    progs = max(1, min(_cdiv(m, rows), TUNE["bwd_programs_per_sm"] * _sm_count(dev) // col_blocks))
    da_part = torch.empty((progs, col_blocks), dtype=torch.float32, device=dev)
    dw_part = torch.empty((progs, n), dtype=torch.float32, device=dev)
    db_part = torch.empty((progs, n), dtype=torch.float32, device=dev) if bias_dtype is not None else dw_part
    launch(
        _dyt_bwd_kernel, (progs, col_blocks),
        x2, alpha, weight, dy2, dx, da_part, dw_part, db_part, m, n, x2.stride(0), dy2.stride(0), dx.stride(0),
        BLOCK_N=block_n, ROWS=rows, HAS_B=bias_dtype is not None, num_warps=warps,
    )  # fmt: skip
    da = _colsum(da_part.view(-1, 1), alpha.dtype).view(alpha.shape)
    db = _colsum(db_part, bias_dtype) if bias_dtype is not None else None
    return dx, da, _colsum(dw_part, weight.dtype), db


# ---------------------------------------------------------------------------------------------
# Registered impl


def _contig(p: torch.Tensor | None) -> torch.Tensor | None:
    return None if p is None else _contig_t(p)


class _DyT(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, alpha, weight, bias):  # type: ignore[override]
        shape = x.shape
        x2 = _as_rows(x, shape[-1])
        w = _contig(weight)
        y = dyt_forward(x2, alpha, w, _contig(bias))
        # the inputs themselves too (x2, w may be other tensors, made here without a graph): a
        # create_graph backward differentiates through them
        ctx.save_for_backward(x2, w, x, alpha, weight, bias)
        ctx.shape = shape
        return _unrows(y, shape)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x2, w, x, alpha, weight, bias = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: the reference's differentiable gradients
            return tuple(graph_grads(reference, (x, alpha, weight, bias), (dy,), ctx.needs_input_grad))
        dx, da, dw, db = dyt_backward(_as_rows(dy, x2.shape[1]), x2, alpha, w, None if bias is None else bias.dtype)
        need = ctx.needs_input_grad
        return (
            _unrows(dx, ctx.shape) if need[0] else None,
            da if need[1] else None,
            dw if need[2] else None,
            db if need[3] else None,
        )


_lean_apply = lean_apply(_DyT)  # _DyT.apply without its Python wrapper (see _autograd.py)


def dyt(x: torch.Tensor, alpha: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The registered impl (arguments already validated by ``polykernel.dyt``)."""
    if _transforms_active():  # functorch (vmap, grad): the kernels cannot read its wrapped tensors
        return _torch_dyt(x, alpha, weight, bias)
    if (x.requires_grad or alpha.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)) and (
        torch.is_grad_enabled()
    ):
        return _lean_apply(x, alpha, weight, bias)
    shape = x.shape
    return _unrows(dyt_forward(_as_rows(x, shape[-1]), alpha, _contig(weight), _contig(bias)), shape)
