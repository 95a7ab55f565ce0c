"""Triton PolyNorm: ``w0·norm(x³) + w1·norm(x²) + w2·norm(x) + b``, forward and backward, any N.

Forward: a [ROWS, BLOCK_N] tile per program; a row that fits one block (N <= MAX_FUSED_N) is
loaded once and its three sums of squares (of x, x², x³) taken from registers; longer rows are
walked in chunks twice. The forward saves the three rstd per row and 1/s (fp32, [M, 4]): all work
on x/s, s a power of two per row (see Kernels).
Backward: a persistent grid of P programs; each walks rows (or row blocks) pid, pid+P, ... and
keeps its share of dW (three numbers) and dB in registers, stored to its own row of [P, 3] and
[P, 1] fp32 buffers that the host sums in a fixed order: no atomics, so the result is
deterministic and the impl is registered ``deterministic=True``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...ops.poly_norm import eps_exponent, reference
from .._double_backward import graph_grads
from .._fallback import registered
from ._autograd import lean_apply
from ._autograd import transforms_active as _transforms_active
from ._colsum import colsum as _colsum
from ._launch import launch
from ._rows import as_rows as _as_rows
from ._rows import cdiv as _cdiv
from ._rows import contig as _contig
from ._rows import row_tile as _tile
from ._rows import sm_count as _sm_count
from ._rows import unrows as _unrows

# what this impl does not take goes to the torch impl, resolved by name on first use (polykernel.backends._fallback)
_torch_poly_norm = registered("norm.poly_norm")

MAX_FUSED_N = 16384  # one block per row up to here; beyond, a chunked walk
CHUNK_N = 4096

# ---------------------------------------------------------------------------------------------
# Kernels
#
# x⁶ overflows fp32 from |x| > 2.6e6 (and underflows below 1e-7): every kernel works on v = x/s, s a
# power of two per row (``ops.poly_norm.scaled``: the reference's scale, here from max|x|'s exponent
# bits; where log2 rounds up to a power of two the two differ by 2, which changes no result: the
# scaling is exact). The norms are scale-invariant, dx gets 1/s; 1/s is saved next to the rstd
# values (which are those of v).


@triton.jit
def _scale_exp(amax, E_FLOOR):
    """The biased exponent of s: amax's (s <= amax < 2s), at least E_FLOOR, at most 253 (1/s normal)."""
    e = amax.to(tl.int32, bitcast=True) >> 23  # amax >= 0 (NaN: 255, clamped: the row is NaN anyway)
    return tl.minimum(tl.maximum(e, E_FLOOR), 253)


@triton.jit
def _pow2(biased):
    """2^(biased - 127), from a biased exponent in [1, 254] (0 gives 0.0)."""
    return (biased << 23).to(tl.float32, bitcast=True)


@triton.jit
def _poly_fwd_kernel(
    X, W, B, Y, RSTD,
    M, N, stride_x, stride_y,
    eps, E_FLOOR,
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr, STORE_STATS: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < M
    mask = row_ok[:, None] & (cols < N)[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    inv = _pow2(254 - _scale_exp(tl.max(tl.abs(x), axis=1), E_FLOOR))  # 1/s per row
    x = x * inv[:, None]  # v = x/s: the kernel's x from here on
    x2 = x * x
    x3 = x2 * x
    t1 = eps * inv * inv  # eps·s^-2p, one factor at a time (inv² alone may overflow)
    t2 = t1 * inv * inv
    r1 = tl.rsqrt(tl.sum(x2, axis=1) / N + t1)
    r2 = tl.rsqrt(tl.sum(x2 * x2, axis=1) / N + t2)
    r3 = tl.rsqrt(tl.sum(x3 * x3, axis=1) / N + t2 * inv * inv)
    w0 = tl.load(W).to(tl.float32)
    w1 = tl.load(W + 1).to(tl.float32)
    w2 = tl.load(W + 2).to(tl.float32)
    b = tl.load(B).to(tl.float32)
    y = x3 * (w0 * r3)[:, None] + x2 * (w1 * r2)[:, None] + x * (w2 * r1)[:, None] + b
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    if STORE_STATS:  # inference needs no rstd: no buffer to allocate
        tl.store(RSTD + rows * 4, r3, mask=row_ok)
        tl.store(RSTD + rows * 4 + 1, r2, mask=row_ok)
        tl.store(RSTD + rows * 4 + 2, r1, mask=row_ok)
        tl.store(RSTD + rows * 4 + 3, inv, mask=row_ok)


@triton.jit
def _poly_fwd_chunked_kernel(
    X, W, B, Y, RSTD,
    N, stride_x, stride_y,
    eps, E_FLOOR,
    CHUNK: tl.constexpr, STORE_STATS: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    y_row = Y + row * stride_y
    cols = tl.arange(0, CHUNK)
    s1 = tl.zeros([CHUNK], dtype=tl.float32)
    s2 = tl.zeros([CHUNK], dtype=tl.float32)
    s3 = tl.zeros([CHUNK], dtype=tl.float32)
    # the row's scale so far (a biased exponent; a tensor: Triton makes an int argument of 1 a
    # constexpr): the sums are of (x/s)^2p
    e = tl.full([], E_FLOOR, tl.int32)
    for start in range(0, N, CHUNK):
        x = tl.load(x_row + start + cols, mask=start + cols < N, other=0.0).to(tl.float32)
        e_new = tl.maximum(e, _scale_exp(tl.max(tl.abs(x), axis=0), E_FLOOR))
        f = _pow2(tl.maximum(127 - (e_new - e), 0))  # s_old/s_new (0 when below fp32's normals)
        f2 = f * f  # rescale what is summed: exact (powers of two), or negligible where it underflows
        s1 = s1 * f2
        s2 = s2 * f2 * f2
        s3 = s3 * f2 * f2 * f2
        e = e_new
        x = x * _pow2(254 - e)
        x2 = x * x
        x3 = x2 * x
        s1 += x2
        s2 += x2 * x2
        s3 += x3 * x3
    inv = _pow2(254 - e)
    t1 = eps * inv * inv  # eps·s^-2p, one factor at a time (inv² alone may overflow)
    t2 = t1 * inv * inv
    r1 = tl.rsqrt(tl.sum(s1, axis=0) / N + t1)
    r2 = tl.rsqrt(tl.sum(s2, axis=0) / N + t2)
    r3 = tl.rsqrt(tl.sum(s3, axis=0) / N + t2 * inv * inv)
    if STORE_STATS:
        tl.store(RSTD + row * 4, r3)
        tl.store(RSTD + row * 4 + 1, r2)
        tl.store(RSTD + row * 4 + 2, r1)
        tl.store(RSTD + row * 4 + 3, inv)
    c3 = tl.load(W).to(tl.float32) * r3
    c2 = tl.load(W + 1).to(tl.float32) * r2
    c1 = tl.load(W + 2).to(tl.float32) * r1
    b = tl.load(B).to(tl.float32)
    for start in range(0, N, CHUNK):
        m = start + cols < N
        x = tl.load(x_row + start + cols, mask=m, other=0.0).to(tl.float32) * inv
        x2 = x * x
        y = x2 * x * c3 + x2 * c2 + x * c1 + b
        tl.store(y_row + start + cols, y.to(Y.dtype.element_ty), mask=m)


@triton.jit
def _poly_bwd_kernel(
    X, W, DY, RSTD, DX, DW_PART, DB_PART,
    M, N, stride_x, stride_dy, stride_dx,
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    progs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w0 = tl.load(W).to(tl.float32)
    w1 = tl.load(W + 1).to(tl.float32)
    w2 = tl.load(W + 2).to(tl.float32)
    dw0 = tl.zeros([ROWS], dtype=tl.float32)
    dw1 = tl.zeros([ROWS], dtype=tl.float32)
    dw2 = tl.zeros([ROWS], dtype=tl.float32)
    db = tl.zeros([ROWS], dtype=tl.float32)
    for block in range(pid, tl.cdiv(M, ROWS), progs):
        rows = tl.cast(block, tl.int64) * ROWS + tl.arange(0, ROWS)
        row_ok = rows < M
        mask = row_ok[:, None] & col_ok[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        g = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        r3 = tl.load(RSTD + rows * 4, mask=row_ok, other=0.0)
        r2 = tl.load(RSTD + rows * 4 + 1, mask=row_ok, other=0.0)
        r1 = tl.load(RSTD + rows * 4 + 2, mask=row_ok, other=0.0)
        inv = tl.load(RSTD + rows * 4 + 3, mask=row_ok, other=0.0)
        x = x * inv[:, None]  # v = x/s, as in the forward
        x2 = x * x
        n3 = x2 * x * r3[:, None]
        n2 = x2 * r2[:, None]
        n1 = x * r1[:, None]
        s3 = tl.sum(g * n3, axis=1)  # Σ dy·n_p per row: dw_p's share, and the backward's mean
        s2 = tl.sum(g * n2, axis=1)
        s1 = tl.sum(g * n1, axis=1)
        dw0 += s3
        dw1 += s2
        dw2 += s1
        db += tl.sum(g, axis=1)
        # dx = Σ_p p·v^(p-1)·r_p·(w_p·g - n_p·w_p·s_p/N) / s
        dx = 3.0 * x2 * (r3 * w0)[:, None] * (g - n3 * (s3 / N)[:, None])
        dx += 2.0 * x * (r2 * w1)[:, None] * (g - n2 * (s2 / N)[:, None])
        dx += (r1 * w2)[:, None] * (g - n1 * (s1 / N)[:, None])
        dx = dx * inv[:, None]
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
    part = tl.cast(pid, tl.int64) * 3
    tl.store(DW_PART + part, tl.sum(dw0, axis=0))
    tl.store(DW_PART + part + 1, tl.sum(dw1, axis=0))
    tl.store(DW_PART + part + 2, tl.sum(dw2, axis=0))
    tl.store(DB_PART + pid, tl.sum(db, axis=0))


@triton.jit
def _poly_bwd_chunked_kernel(
    X, W, DY, RSTD, DX, DW_PART, DB_PART,
    M, N, stride_x, stride_dy, stride_dx,
    CHUNK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    progs = tl.num_programs(0)
    cols = tl.arange(0, CHUNK)
    w0 = tl.load(W).to(tl.float32)
    w1 = tl.load(W + 1).to(tl.float32)
    w2 = tl.load(W + 2).to(tl.float32)
    dw0 = 0.0
    dw1 = 0.0
    dw2 = 0.0
    db = 0.0
    for row in range(pid, M, progs):
        row64 = tl.cast(row, tl.int64)
        r3 = tl.load(RSTD + row64 * 4)
        r2 = tl.load(RSTD + row64 * 4 + 1)
        r1 = tl.load(RSTD + row64 * 4 + 2)
        inv = tl.load(RSTD + row64 * 4 + 3)  # v = x/s, as in the forward
        a3 = tl.zeros([CHUNK], dtype=tl.float32)
        a2 = tl.zeros([CHUNK], dtype=tl.float32)
        a1 = tl.zeros([CHUNK], dtype=tl.float32)
        a0 = tl.zeros([CHUNK], dtype=tl.float32)
        for start in range(0, N, CHUNK):
            m = start + cols < N
            x = tl.load(X + row64 * stride_x + start + cols, mask=m, other=0.0).to(tl.float32) * inv
            g = tl.load(DY + row64 * stride_dy + start + cols, mask=m, other=0.0).to(tl.float32)
            x2 = x * x
            a3 += g * x2 * x
            a2 += g * x2
            a1 += g * x
            a0 += g
        s3 = tl.sum(a3, axis=0) * r3
        s2 = tl.sum(a2, axis=0) * r2
        s1 = tl.sum(a1, axis=0) * r1
        dw0 += s3
        dw1 += s2
        dw2 += s1
        db += tl.sum(a0, axis=0)
        for start in range(0, N, CHUNK):
            m = start + cols < N
            x = tl.load(X + row64 * stride_x + start + cols, mask=m, other=0.0).to(tl.float32) * inv
            g = tl.load(DY + row64 * stride_dy + start + cols, mask=m, other=0.0).to(tl.float32)
            x2 = x * x
            dx = 3.0 * x2 * (r3 * w0) * (g - x2 * x * r3 * (s3 / N))
            dx += 2.0 * x * (r2 * w1) * (g - x2 * r2 * (s2 / N))
            dx += (r1 * w2) * (g - x * r1 * (s1 / N))
            dx = dx * inv
            tl.store(DX + row64 * stride_dx + start + cols, dx.to(DX.dtype.element_ty), mask=m)
    part = tl.cast(pid, tl.int64) * 3
    tl.store(DW_PART + part, dw0)
    tl.store(DW_PART + part + 1, dw1)
    tl.store(DW_PART + part + 2, dw2)
    tl.store(DB_PART + pid, db)


# ---------------------------------------------------------------------------------------------
# Host launchers

# Launch settings (a sweep may override them to measure alternatives).
TUNE = {
    "fwd_tile_elems": 4096,  # elements per program for short rows (ROWS = this // BLOCK_N)
    "bwd_tile_elems": 4096,
    "warps": None,  # None: by tile size (see _rows.row_tile)
    "bwd_programs_per_sm": 2,  # persistent grid of the backward
}


def poly_norm_forward(
    x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, need_stats: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """y [M, N] in x's dtype and stats [M, 4] fp32 (rstd of v³, v², v with v = x/s, and 1/s; None
    unless ``need_stats``)."""
    m, n = x2.shape
    y = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    rstd = torch.empty((m, 4), dtype=torch.float32, device=x2.device) if need_stats else None
    if m == 0 or n == 0:
        return y, rstd
    stats = y if rstd is None else rstd  # never written without STORE_STATS
    e_floor = min(max(eps_exponent(eps), -126), 126) + 127  # the reference's floor of s, biased
    if n <= MAX_FUSED_N:
        block_n, rows, warps = _tile(n, TUNE["fwd_tile_elems"], TUNE["warps"])
        launch(
            _poly_fwd_kernel, (_cdiv(m, rows),),
            x2, weight, bias, y, stats, m, n, x2.stride(0), y.stride(0), eps, e_floor,
            BLOCK_N=block_n, ROWS=rows, STORE_STATS=need_stats, num_warps=warps,
        )  # fmt: skip
    else:
        launch(
            _poly_fwd_chunked_kernel, (m,),
            x2, weight, bias, y, stats, n, x2.stride(0), y.stride(0), eps, e_floor,
            CHUNK=CHUNK_N, STORE_STATS=need_stats, num_warps=16,
        )  # fmt: skip
    return y, rstd


def poly_norm_backward(
    dy2: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dx [M, N] in x's dtype, dW [3] in weight's dtype, dB in bias's dtype and shape."""
    m, n = x2.shape
    dev = x2.device
    dx = torch.empty((m, n), dtype=x2.dtype, device=dev)
    if m == 0 or n == 0:
        return dx, torch.zeros(3, dtype=weight.dtype, device=dev), torch.zeros_like(bias)
    progs = min(TUNE["bwd_programs_per_sm"] * _sm_count(dev), m)
    chunked = n > MAX_FUSED_N
    if not chunked:
        block_n, rows, warps = _tile(n, TUNE["bwd_tile_elems"], TUNE["warps"])
        progs = min(progs, _cdiv(m, rows))
    dw_part = torch.empty((progs, 3), dtype=torch.float32, device=dev)
    db_part = torch.empty((progs, 1), dtype=torch.float32, device=dev)
    if not chunked:
        launch(
            _poly_bwd_kernel, (progs,),
            x2, weight, dy2, rstd, dx, dw_part, db_part, m, n, x2.stride(0), dy2.stride(0), dx.stride(0),
            BLOCK_N=block_n, ROWS=rows, num_warps=warps,
        )  # fmt: skip
    else:
        launch(
            _poly_bwd_chunked_kernel, (progs,),
            x2, weight, dy2, rstd, dx, dw_part, db_part, m, n, x2.stride(0), dy2.stride(0), dx.stride(0),
            CHUNK=CHUNK_N, num_warps=16,
        )  # fmt: skip
    return dx, _colsum(dw_part, weight.dtype), _colsum(db_part, bias.dtype).view(bias.shape)


# ---------------------------------------------------------------------------------------------
# Registered impl


class _PolyNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):  # type: ignore[override]
        shape = x.shape
        x2 = _as_rows(x, shape[-1])
        w, b = _contig(weight), _contig(bias)
        y, rstd = poly_norm_forward(x2, w, b, eps)
        # the inputs themselves too (x2, w, b may be other tensors, made here without a graph): a
        # create_graph backward differentiates through them
        ctx.save_for_backward(x2, w, b, rstd, x, weight, bias)
        ctx.shape, ctx.eps = shape, eps
        return _unrows(y, shape)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x2, w, b, rstd, x, weight, bias = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: the reference's differentiable gradients
            return (*graph_grads(reference, (x, weight, bias, ctx.eps), (dy,), (*ctx.needs_input_grad[:3], False)),)
        dx, dw, db = poly_norm_backward(_as_rows(dy, x2.shape[1]), x2, w, b, rstd)
        need = ctx.needs_input_grad
        return (_unrows(dx, ctx.shape) if need[0] else None, dw if need[1] else None, db if need[2] else None, None)


_lean_apply = lean_apply(_PolyNorm)  # _PolyNorm.apply without its Python wrapper (see _autograd.py)


def poly_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """The registered impl (arguments already validated by ``polykernel.poly_norm``)."""
    if _transforms_active():  # functorch (vmap, grad): the kernels cannot read its wrapped tensors
        return _torch_poly_norm(x, weight, bias, eps)
    if (x.requires_grad or weight.requires_grad or bias.requires_grad) and torch.is_grad_enabled():
        return _lean_apply(x, weight, bias, eps)
    shape = x.shape
    y, _ = poly_norm_forward(_as_rows(x, shape[-1]), _contig(weight), _contig(bias), eps, need_stats=False)
    return _unrows(y, shape)
