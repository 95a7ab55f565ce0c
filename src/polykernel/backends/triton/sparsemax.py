"""Triton sparsemax: ``max(x - τ, 0)`` per row with ``Σ y = 1``, forward and backward, any N.

No sort. On ``z = x - max(x)`` (the op file says why), the threshold is found by Michelot's
support refinement: from ``τ₀ = -1`` (a lower bound: the maximum alone gives ``Σ relu(z - τ₀)
>= 1``), repeat ``S = {z > τ}``, ``τ = (Σ_S z - 1) / |S|``. Each step keeps τ below the exact
threshold and shrinks S; when S stops shrinking, τ is exact (Michelot 1986). A row stops at the
first step whose support does not shrink, so a row takes at most N steps (a handful in
practice) whatever the rounding. τ is divided with IEEE rounding (``div_rn``; Triton's ``/`` is
approximate on the GPU): with 16-bit inputs a logit often sits exactly at τ (the sums of their
differences hit 1 exactly), where it must stay outside the support, as in exact arithmetic.

Rows that fit one block (N <= MAX_FUSED_N) are loaded once, ``ROWS`` rows per program, and the
steps run on registers; longer rows are walked in chunks, one pass per step. The forward saves
each row's max and τ (fp32, [M] each: 0 and NaN for the rows that come back NaN); the backward
rebuilds the support ``{x - max > τ}`` from them (the forward's own test, bit for bit) and
writes ``dx = dy - mean_S(dy)`` on it, 0 elsewhere. No atomics: deterministic.

``dim`` other than the last moves to the last (a copy when the layout needs it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...ops.sparsemax import reference
from .._double_backward import graph_grads
from .._fallback import registered
from ._autograd import lean_apply
from ._autograd import transforms_active as _transforms_active
from ._launch import launch
from ._rows import as_rows as _as_rows
from ._rows import cdiv as _cdiv
from ._rows import row_tile as _tile

# what this impl does not take goes to the torch impl, resolved by name on first use (polykernel.backends._fallback)
_torch_sparsemax = registered("activation.sparsemax")

MAX_FUSED_N = 16384  # one block per row up to here; beyond, chunked passes
CHUNK_N = 4096

# ---------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _sparsemax_fwd_kernel(
    X, Y, MAX, TAU,
    M, N, stride_x, stride_y,
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr, STORE_STATS: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < M
    mask = row_ok[:, None] & (cols < N)[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=float("-inf")).to(tl.float32)
    m = tl.max(x, axis=1)
    nans = tl.sum((x != x).to(tl.int32), axis=1)
    bad = (nans > 0) | (m == float("inf")) | (m == float("-inf")) | (rows >= M)
    m = tl.where(bad, 0.0, m)  # (no inf - inf on those rows: their τ is NaN, their y NaN)
    z = x - m[:, None]  # masked lanes: -inf, never in the support
    tau = tl.full([ROWS], -1.0, tl.float32)
    k = tl.sum((z > tau[:, None]).to(tl.int32), axis=1)
    done = bad.to(tl.int32)
    while tl.sum(1 - done, axis=0) > 0:
        new = tl.div_rn(tl.sum(tl.where(z > tau[:, None], z, 0.0), axis=1) - 1.0, tl.maximum(k, 1).to(tl.float32))
        tau = tl.where(done != 0, tau, new)
        k_new = tl.sum((z > tau[:, None]).to(tl.int32), axis=1)
        done = done | (k_new >= k).to(tl.int32)  # S stopped shrinking: τ (from S) is the threshold
        k = k_new
    tau = tl.where(bad, float("nan"), tau)
    y = tl.where(z > tau[:, None], z - tau[:, None], 0.0)
    y = tl.where(bad[:, None], float("nan"), y)
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    if STORE_STATS:
        tl.store(MAX + rows, m, mask=row_ok)
        tl.store(TAU + rows, tau, mask=row_ok)


@triton.jit
def _support(x_row, N, m, tau, CHUNK: tl.constexpr):
    """(|S|, Σ_S z) of one row for the threshold τ: one pass over its chunks."""
    cols = tl.arange(0, CHUNK)
    k = tl.zeros([CHUNK], dtype=tl.int32)
    s = tl.zeros([CHUNK], dtype=tl.float32)
    for start in range(0, N, CHUNK):
        z = tl.load(x_row + start + cols, mask=start + cols < N, other=float("-inf")).to(tl.float32) - m
        inside = z > tau
        k += inside.to(tl.int32)
        s += tl.where(inside, z, 0.0)
    return tl.sum(k, axis=0), tl.sum(s, axis=0)


@triton.jit
def _sparsemax_fwd_chunked_kernel(
    X, Y, MAX, TAU,
    N, stride_x, stride_y,
    CHUNK: tl.constexpr, STORE_STATS: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    y_row = Y + row * stride_y
    cols = tl.arange(0, CHUNK)
    mx = tl.full([CHUNK], float("-inf"), tl.float32)
    nans = tl.zeros([CHUNK], dtype=tl.int32)
    for start in range(0, N, CHUNK):
        x = tl.load(x_row + start + cols, mask=start + cols < N, other=float("-inf")).to(tl.float32)
        mx = tl.maximum(mx, x)
        nans += (x != x).to(tl.int32)
    m = tl.max(mx, axis=0)
    bad = (tl.sum(nans, axis=0) > 0) | (m == float("inf")) | (m == float("-inf"))
    m = tl.where(bad, 0.0, m)  # (no inf - inf on that row: its τ is NaN, its y NaN)
    tau = tl.full((), -1.0, tl.float32)
    if bad:
        tau = tl.full((), float("nan"), tl.float32)
    else:
        k, s = _support(x_row, N, m, tau, CHUNK)
        done = tl.zeros((), tl.int32)
        while done == 0:
            tau = tl.div_rn(s - 1.0, k.to(tl.float32))  # k >= 1: the max is always in S
            k_new, s = _support(x_row, N, m, tau, CHUNK)
            done = (k_new >= k).to(tl.int32)  # S stopped shrinking: τ (from S) is the threshold
            k = k_new
    for start in range(0, N, CHUNK):
        c = start + cols < N
        z = tl.load(x_row + start + cols, mask=c, other=0.0).to(tl.float32) - m
        y = tl.where(z > tau, z - tau, 0.0)
        if bad:
            y = tl.full([CHUNK], float("nan"), tl.float32)
        tl.store(y_row + start + cols, y.to(Y.dtype.element_ty), mask=c)
    if STORE_STATS:
        tl.store(MAX + row, m)
        tl.store(TAU + row, tau)


@triton.jit
def _sparsemax_bwd_kernel(
    X, DY, MAX, TAU, DX,
    M, N, stride_x, stride_dy, stride_dx,
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < M
    mask = row_ok[:, None] & (cols < N)[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=float("-inf")).to(tl.float32)
    dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    m = tl.load(MAX + rows, mask=row_ok, other=0.0)
    tau = tl.load(TAU + rows, mask=row_ok, other=float("nan"))
    inside = (x - m[:, None]) > tau[:, None]  # the forward's test (NaN τ: an empty support)
    g = tl.where(inside, dy, 0.0)
    mean = tl.sum(g, axis=1) / tl.maximum(tl.sum(inside.to(tl.int32), axis=1), 1).to(tl.float32)
    dx = tl.where(inside, g - mean[:, None], 0.0)
    tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)


@triton.jit
def _sparsemax_bwd_chunked_kernel(
    X, DY, MAX, TAU, DX,
    N, stride_x, stride_dy, stride_dx,
    CHUNK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, CHUNK)
    m = tl.load(MAX + row)
    tau = tl.load(TAU + row)
    k = tl.zeros([CHUNK], dtype=tl.int32)
    s = tl.zeros([CHUNK], dtype=tl.float32)
    for start in range(0, N, CHUNK):
        c = start + cols < N
        x = tl.load(X + row * stride_x + start + cols, mask=c, other=float("-inf")).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + start + cols, mask=c, other=0.0).to(tl.float32)
        inside = (x - m) > tau
        k += inside.to(tl.int32)
        s += tl.where(inside, dy, 0.0)
    mean = tl.sum(s, axis=0) / tl.maximum(tl.sum(k, axis=0), 1).to(tl.float32)
    for start in range(0, N, CHUNK):
        c = start + cols < N
        x = tl.load(X + row * stride_x + start + cols, mask=c, other=float("-inf")).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + start + cols, mask=c, other=0.0).to(tl.float32)
        dx = tl.where((x - m) > tau, dy - mean, 0.0)
        tl.store(DX + row * stride_dx + start + cols, dx.to(DX.dtype.element_ty), mask=c)


# ---------------------------------------------------------------------------------------------
# Host launchers

# Launch settings (a sweep may override them to measure alternatives).
TUNE = {"tile_elems": 4096, "warps": None}  # short rows: ROWS = tile_elems // BLOCK_N per program


def sparsemax_forward(x2: torch.Tensor, need_stats: bool = True) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """y [M, N] in x's dtype; each row's max and τ, fp32 [M] (None unless ``need_stats``)."""
    m, n = x2.shape
    y = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    rmax = torch.empty(m, dtype=torch.float32, device=x2.device) if need_stats else None
    tau = torch.empty(m, dtype=torch.float32, device=x2.device) if need_stats else None
    if m == 0 or n == 0:
        return y, rmax, tau
    stats = (y, y) if rmax is None else (rmax, tau)  # never written without STORE_STATS
    if n <= MAX_FUSED_N:
        block_n, rows, warps = _tile(n, TUNE["tile_elems"], TUNE["warps"])
        launch(
            _sparsemax_fwd_kernel, (_cdiv(m, rows),),
            x2, y, *stats, m, n, x2.stride(0), y.stride(0),
            BLOCK_N=block_n, ROWS=rows, STORE_STATS=need_stats, num_warps=warps,
        )  # fmt: skip
    else:
        launch(
            _sparsemax_fwd_chunked_kernel, (m,),
            x2, y, *stats, n, x2.stride(0), y.stride(0),
            CHUNK=CHUNK_N, STORE_STATS=need_stats, num_warps=16,
        )  # fmt: skip
    return y, rmax, tau


def sparsemax_backward(dy2: torch.Tensor, x2: torch.Tensor, rmax: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """dx [M, N] in x's dtype."""
    m, n = x2.shape
    dx = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    if m == 0 or n == 0:
        return dx
    if n <= MAX_FUSED_N:
        block_n, rows, warps = _tile(n, TUNE["tile_elems"], TUNE["warps"])
        launch(
            _sparsemax_bwd_kernel, (_cdiv(m, rows),),
            x2, dy2, rmax, tau, dx, m, n, x2.stride(0), dy2.stride(0), dx.stride(0),
            BLOCK_N=block_n, ROWS=rows, num_warps=warps,
        )  # fmt: skip
    else:
        launch(
            _sparsemax_bwd_chunked_kernel, (m,),
            x2, dy2, rmax, tau, dx, n, x2.stride(0), dy2.stride(0), dx.stride(0),
            CHUNK=CHUNK_N, num_warps=16,
        )  # fmt: skip
    return dx


# ---------------------------------------------------------------------------------------------
# Registered impl


def _last(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Size]:
    """x with ``dim`` moved last, as [M, N] rows with unit column stride, and the moved shape."""
    xt = x.movedim(dim, -1)
    return _as_rows(xt, xt.shape[-1]), xt.shape


def _back(t2: torch.Tensor, shape: torch.Size, dim: int) -> torch.Tensor:
    """A [M, N] result in x's shape (``dim`` moved back: a view)."""
    return t2.view(shape).movedim(-1, dim)


class _Sparsemax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim):  # type: ignore[override]
        x2, shape = _last(x, dim)
        y, rmax, tau = sparsemax_forward(x2)
        ctx.save_for_backward(x2, rmax, tau, x)  # x: a create_graph backward differentiates through it
        ctx.layout = (shape, dim)
        return _back(y, shape, dim)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x2, rmax, tau, x = ctx.saved_tensors
        shape, dim = ctx.layout
        if torch.is_grad_enabled():  # create_graph=True: the reference's differentiable gradient
            return graph_grads(reference, (x, dim), (dy,), (True, False))[0], None
        dy2, _ = _last(dy, dim)
        return _back(sparsemax_backward(dy2, x2, rmax, tau), shape, dim), None


_lean_apply = lean_apply(_Sparsemax)  # _Sparsemax.apply without its Python wrapper (see _autograd.py)


def sparsemax(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The registered impl (arguments already validated by ``polykernel.sparsemax``)."""
    if _transforms_active():  # functorch (vmap, grad): the kernels cannot read its wrapped tensors
        return _torch_sparsemax(x, dim)
    if x.requires_grad and torch.is_grad_enabled():
        return _lean_apply(x, dim)
    x2, shape = _last(x, dim)
    return _back(sparsemax_forward(x2, need_stats=False)[0], shape, dim)
