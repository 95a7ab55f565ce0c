"""Triton softmax over the last dim: forward and backward, any N, any leading shape.

Forward (fp32 math, output in x's dtype):

* rows that fit one block (N <= MAX_FUSED_N) are loaded once into registers: max, exp, sum,
  scale, store — one read and one write per element. Short rows share a program
  (a ``[ROWS, BLOCK_N]`` tile of ~4K elements).
* longer rows use an online softmax over chunks of CHUNK_N: pass 1 keeps a running max ``m`` and
  a running ``s = Σ exp(x - m)`` rescaled whenever ``m`` grows (per-chunk reductions, so one exp
  per element); pass 2 re-reads the chunks (mostly from L2) and writes ``exp(x - m) / s``. When
  there are too few rows to fill the GPU, each row is split into ``S`` segments: a stats kernel
  writes a per-segment ``(m_i, s_i)``, and the normalize kernel of each segment merges its row's
  ``S`` pairs (fixed order: deterministic) before writing its segment.

Backward: ``dx = y · (dy - Σ dy·y)`` with y recomputed in fp32 from the saved input x and the
per-row ``(max, 1/sum)`` the forward wrote (8 bytes a row), so the gradient is the fp32 one of
the contract (a y saved in bf16 would carry its rounding into ``Σ dy·y``); the same bytes move
(x instead of y). Same structure: one block per row up to MAX_FUSED_N_BWD, chunked (split when
rows are few) beyond; the row dot is reduced in a fixed order, no atomics (deterministic).
Rows of -inf logits give 0 where torch gives 0 and NaN for an all -inf row (as torch).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ...ops.softmax import reference
from ...spec import Split
from .._double_backward import graph_grads
from .._fallback import registered
from ._autograd import lean_apply
from ._autograd import transforms_active as _transforms_active
from ._launch import launch
from ._rows import as_rows as _as_rows
from ._rows import cdiv as _cdiv
from ._rows import next_pow2 as _next_pow2
from ._rows import sm_count as _sm_count

# what this impl does not take goes to the torch impl, resolved by name on first use (polykernel.backends._fallback)
_torch_softmax = registered("activation.softmax")

# Tiling (sm_90, checked by compiling for it: no register spills, 16-byte accesses; not yet timed).
MAX_FUSED_N = 32768  # forward: one block per row up to here (a 32K fp32 row: 32 registers/thread at 32 warps)
MAX_FUSED_N_BWD = 32768  # backward one block up to here: faster than chunked, spills and all (notes/PERF.md, 2026-11-29)
CHUNK_N = 8192  # chunk of the online (long-row) paths, 16 warps: 2 programs per SM
CHUNK_WARPS = 16
TILE = 4096  # elements per program for short rows


# ---------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _softmax_fwd_kernel(
    X, Y, RMAX, RINV, M, N, stride_x, stride_y,
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr, STATS: tl.constexpr,
):  # fmt: skip
    rows = tl.cast(tl.program_id(0), tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < M
    mask = row_ok[:, None] & (cols < N)[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=-float("inf")).to(tl.float32)
    m = tl.max(x, axis=1)
    e = tl.exp(x - m[:, None])
    inv = 1.0 / tl.sum(e, axis=1)
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], (e * inv[:, None]).to(Y.dtype.element_ty), mask=mask)
    if STATS:
        tl.store(RMAX + rows, m, mask=row_ok)
        tl.store(RINV + rows, inv, mask=row_ok)


@triton.jit
def _online_stats(x_row, c_lo, c_hi, N, CHUNK: tl.constexpr):
    """Running (max, Σ exp(x - max)) of chunks [c_lo, c_hi) of x_row, one exp per element."""
    cols = tl.arange(0, CHUNK)
    m = tl.max(tl.full([CHUNK], -float("inf"), tl.float32), axis=0)
    s = tl.sum(tl.zeros([CHUNK], tl.float32), axis=0)
    for ci in range(c_lo, c_hi):
        c0 = ci * CHUNK  # a multiple of CHUNK, and the mask is against N: 16-byte accesses
        x = tl.load(x_row + c0 + cols, mask=c0 + cols < N, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        # while every value seen is -inf, keep s = 0 (exp(-inf - -inf) would be NaN)
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe), axis=0)
        m = m_new
    return m, s


@triton.jit
def _seg_chunks(pid, S, seg_chunks, N, CHUNK: tl.constexpr):
    """(row, first chunk, end chunk) of program pid in a split launch (S segments a row)."""
    row = pid // S
    c_lo = (pid - row * S) * seg_chunks
    c_hi = tl.minimum(c_lo + seg_chunks, tl.cdiv(N, CHUNK))
    return row, c_lo, c_hi


@triton.jit
def _softmax_stats_kernel(
    X, MS, SS, N, stride_x, seg_chunks, S,
    CHUNK: tl.constexpr,
):  # fmt: skip
    """Per (row, segment): the segment's running max and sum, into MS/SS [M, S]."""
    pid = tl.program_id(0)
    row, c_lo, c_hi = _seg_chunks(pid, S, seg_chunks, N, CHUNK)
    m, s = _online_stats(X + tl.cast(row, tl.int64) * stride_x, c_lo, c_hi, N, CHUNK)
    tl.store(MS + tl.cast(pid, tl.int64), m)
    tl.store(SS + tl.cast(pid, tl.int64), s)


@triton.jit
def _softmax_fwd_chunked_kernel(
    X, Y, MS, SS, RMAX, RINV, N, stride_x, stride_y, seg_chunks, S,
    CHUNK: tl.constexpr, S_POW2: tl.constexpr, SPLIT: tl.constexpr, STATS: tl.constexpr,
):  # fmt: skip
    """Writes y for one (row, segment); SPLIT: merge the row's S stats, else compute them here (S == 1)."""
    pid = tl.program_id(0)
    row, c_lo, c_hi = _seg_chunks(pid, S, seg_chunks, N, CHUNK)
    row64 = tl.cast(row, tl.int64)
    x_row = X + row64 * stride_x
    y_row = Y + row64 * stride_y
    if SPLIT:
        k = tl.arange(0, S_POW2)
        ms = tl.load(MS + row64 * S + k, mask=k < S, other=-float("inf"))
        ss = tl.load(SS + row64 * S + k, mask=k < S, other=0.0)
        m = tl.max(ms, axis=0)
        m_safe = tl.where(m == -float("inf"), 0.0, m)
        s = tl.sum(ss * tl.exp(ms - m_safe), axis=0)
    else:
        m, s = _online_stats(x_row, 0, tl.cdiv(N, CHUNK), N, CHUNK)
    inv = 1.0 / s
    if STATS:
        if c_lo == 0:  # the row's first segment
            tl.store(RMAX + row64, m)
            tl.store(RINV + row64, inv)
    cols = tl.arange(0, CHUNK)
    for ci in range(c_lo, c_hi):
        c0 = ci * CHUNK
        msk = c0 + cols < N
        x = tl.load(x_row + c0 + cols, mask=msk, other=0.0).to(tl.float32)
        tl.store(y_row + c0 + cols, (tl.exp(x - m) * inv).to(Y.dtype.element_ty), mask=msk)


@triton.jit
def _softmax_bwd_kernel(
    X, DY, DX, RMAX, RINV, M, N, stride_x, stride_dy, stride_dx,
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    """dx = y·(dy - Σ y·dy) with y recomputed in fp32 from x and the row's (max, 1/sum)."""
    rows = tl.cast(tl.program_id(0), tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < M
    mask = row_ok[:, None] & (cols < N)[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=-float("inf")).to(tl.float32)
    dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    m = tl.load(RMAX + rows, mask=row_ok, other=0.0)
    inv = tl.load(RINV + rows, mask=row_ok, other=0.0)
    y = tl.exp(x - m[:, None]) * inv[:, None]
    dot = tl.sum(y * dy, axis=1)
    tl.store(DX + rows[:, None] * stride_dx + cols[None, :], (y * (dy - dot[:, None])).to(DX.dtype.element_ty), mask=mask)


@triton.jit
def _row_dot(x_row, dy_row, m, inv, c_lo, c_hi, N, CHUNK: tl.constexpr):
    """Σ y·dy over chunks [c_lo, c_hi) of the row, y = exp(x - m)·inv."""
    cols = tl.arange(0, CHUNK)
    acc = tl.zeros([CHUNK], dtype=tl.float32)
    for ci in range(c_lo, c_hi):
        c0 = ci * CHUNK
        msk = c0 + cols < N
        x = tl.load(x_row + c0 + cols, mask=msk, other=-float("inf")).to(tl.float32)
        dy = tl.load(dy_row + c0 + cols, mask=msk, other=0.0).to(tl.float32)
        acc += tl.where(msk, tl.exp(x - m) * inv * dy, 0.0)
    return tl.sum(acc, axis=0)


@triton.jit
def _softmax_dot_kernel(
    X, DY, RMAX, RINV, DOT, N, stride_x, stride_dy, seg_chunks, S,
    CHUNK: tl.constexpr,
):  # fmt: skip
    """Per (row, segment): Σ y·dy over the segment, into DOT [M, S]."""
    pid = tl.program_id(0)
    row, c_lo, c_hi = _seg_chunks(pid, S, seg_chunks, N, CHUNK)
    row64 = tl.cast(row, tl.int64)
    m = tl.load(RMAX + row64)
    inv = tl.load(RINV + row64)
    dot = _row_dot(X + row64 * stride_x, DY + row64 * stride_dy, m, inv, c_lo, c_hi, N, CHUNK)
    tl.store(DOT + tl.cast(pid, tl.int64), dot)


@triton.jit
def _softmax_bwd_chunked_kernel(
    X, DY, DX, RMAX, RINV, DOT, N, stride_x, stride_dy, stride_dx, seg_chunks, S,
    CHUNK: tl.constexpr, S_POW2: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    row, c_lo, c_hi = _seg_chunks(pid, S, seg_chunks, N, CHUNK)
    row64 = tl.cast(row, tl.int64)
    x_row = X + row64 * stride_x
    dy_row = DY + row64 * stride_dy
    dx_row = DX + row64 * stride_dx
    m = tl.load(RMAX + row64)
    inv = tl.load(RINV + row64)
    if SPLIT:
        k = tl.arange(0, S_POW2)
        dot = tl.sum(tl.load(DOT + row64 * S + k, mask=k < S, other=0.0), axis=0)
    else:
        dot = _row_dot(x_row, dy_row, m, inv, 0, tl.cdiv(N, CHUNK), N, CHUNK)
    cols = tl.arange(0, CHUNK)
    for ci in range(c_lo, c_hi):
        c0 = ci * CHUNK
        msk = c0 + cols < N
        x = tl.load(x_row + c0 + cols, mask=msk, other=0.0).to(tl.float32)
        dy = tl.load(dy_row + c0 + cols, mask=msk, other=0.0).to(tl.float32)
        y = tl.exp(x - m) * inv
        tl.store(dx_row + c0 + cols, (y * (dy - dot)).to(DX.dtype.element_ty), mask=msk)


# ---------------------------------------------------------------------------------------------
# Host launchers


def _tile(n: int) -> tuple[int, int, int]:
    """(BLOCK_N, ROWS, num_warps) for rows that fit one block: >= TILE elements per program."""
    block_n = _next_pow2(max(n, 1))
    rows = max(1, TILE // block_n)
    size = block_n * rows
    warps = 4 if size <= 2048 else 8 if size <= 4096 else 16 if size <= 16384 else 32
    return block_n, rows, warps


@functools.cache
def _programs(device: torch.device) -> int:
    """How many programs fill the device: 4 per SM on GPU (8 on the interpreter)."""
    return 4 * _sm_count(device)


def _split(m: int, n: int, device: torch.device) -> tuple[int, int]:
    """(segments per row S, chunks per segment): S > 1 only when m rows cannot fill the device."""
    chunks = _cdiv(n, CHUNK_N)
    s = max(1, min(chunks, _cdiv(_programs(device), m)))
    seg_chunks = _cdiv(chunks, s)
    return _cdiv(chunks, seg_chunks), seg_chunks


def softmax_forward(x2: torch.Tensor, stats: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """y [M, N] (contiguous) in x's dtype; with ``stats``, also each row's max and 1/sum (fp32)."""
    m, n = x2.shape
    y = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    rmax = torch.empty(m, dtype=torch.float32, device=x2.device) if stats else None
    rinv = torch.empty(m, dtype=torch.float32, device=x2.device) if stats else None
    if m == 0 or n == 0:
        return y, rmax, rinv
    rm, ri = (rmax, rinv) if stats else (y, y)  # unused pointers when STATS=False
    if n <= MAX_FUSED_N:
        block_n, rows, warps = _tile(n)
        launch(
            _softmax_fwd_kernel,
            (_cdiv(m, rows),),
            x2,
            y,
            rm,
            ri,
            m,
            n,
            x2.stride(0),
            y.stride(0),
            BLOCK_N=block_n,
            ROWS=rows,
            STATS=stats,
            num_warps=warps,
        )
        return y, rmax, rinv
    s, seg_chunks = _split(m, n, x2.device)
    if s > 1:
        ms = torch.empty((m, s), dtype=torch.float32, device=x2.device)
        ss = torch.empty((m, s), dtype=torch.float32, device=x2.device)
        launch(_softmax_stats_kernel, (m * s,), x2, ms, ss, n, x2.stride(0), seg_chunks, s, CHUNK=CHUNK_N, num_warps=CHUNK_WARPS)
    else:
        ms = ss = y  # unused (SPLIT=False)
    launch(
        _softmax_fwd_chunked_kernel, (m * s,),
        x2, y, ms, ss, rm, ri, n, x2.stride(0), y.stride(0), seg_chunks, s,
        CHUNK=CHUNK_N, S_POW2=_next_pow2(s), SPLIT=s > 1, STATS=stats, num_warps=CHUNK_WARPS,
    )  # fmt: skip
    return y, rmax, rinv


def softmax_backward(dy2: torch.Tensor, x2: torch.Tensor, rmax: torch.Tensor, rinv: torch.Tensor) -> torch.Tensor:
    """dx [M, N] (contiguous) in x's dtype, recomputing y in fp32 from x and the row stats."""
    m, n = x2.shape
    dx = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    if m == 0 or n == 0:
        return dx
    if n <= MAX_FUSED_N_BWD:
        block_n, rows, warps = _tile(n)
        launch(
            _softmax_bwd_kernel,
            (_cdiv(m, rows),),
            x2,
            dy2,
            dx,
            rmax,
            rinv,
            m,
            n,
            x2.stride(0),
            dy2.stride(0),
            dx.stride(0),
            BLOCK_N=block_n,
            ROWS=rows,
            num_warps=warps,
        )
        return dx
    s, seg_chunks = _split(m, n, x2.device)
    if s > 1:
        dot = torch.empty((m, s), dtype=torch.float32, device=x2.device)
        launch(
            _softmax_dot_kernel,
            (m * s,),
            x2,
            dy2,
            rmax,
            rinv,
            dot,
            n,
            x2.stride(0),
            dy2.stride(0),
            seg_chunks,
            s,
            CHUNK=CHUNK_N,
            num_warps=CHUNK_WARPS,
        )
    else:
        dot = rmax  # unused (SPLIT=False)
    launch(
        _softmax_bwd_chunked_kernel, (m * s,),
        x2, dy2, dx, rmax, rinv, dot, n, x2.stride(0), dy2.stride(0), dx.stride(0), seg_chunks, s,
        CHUNK=CHUNK_N, S_POW2=_next_pow2(s), SPLIT=s > 1, num_warps=CHUNK_WARPS,
    )  # fmt: skip
    return dx


# ---------------------------------------------------------------------------------------------
# Registered impl


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        x2 = _as_rows(x, x.shape[-1])
        y, rmax, rinv = softmax_forward(x2, True)
        # x itself as well where x2 is another tensor (made here, without a graph): a create_graph
        # backward differentiates through it
        if x2 is x:
            ctx.save_for_backward(x2, rmax, rinv)
        else:
            ctx.save_for_backward(x2, rmax, rinv, x)
        ctx.shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x2, rmax, rinv, *inputs = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: a differentiable gradient, by the reference
            return graph_grads(reference, (inputs[0] if inputs else x2,), (dy,), (True,))[0]
        return softmax_backward(_as_rows(dy, x2.shape[1]), x2, rmax, rinv).view(ctx.shape)


_lean_apply = lean_apply(_Softmax)  # _Softmax.apply without its Python wrapper (see _autograd.py)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """The registered impl (arguments already validated by ``polykernel.softmax``)."""
    if _transforms_active():  # functorch (vmap, grad): the kernels cannot read its wrapped tensors
        return _torch_softmax(x)
    if torch.is_grad_enabled() and x.requires_grad:
        return _lean_apply(x)
    return softmax_forward(_as_rows(x, x.shape[-1]), False)[0].view(x.shape)


# Forward and backward as separate functions, for compiled graphs (polykernel.compile.library): the
# backward kernel runs on the saved row stats, no recompute of the forward. Saved layout: the
# torch impl's (row max and 1/sum, fp32 [M]).
def _split_forward(x, grad_mask):
    y, rmax, rinv = softmax_forward(_as_rows(x, x.shape[-1]), True)
    return (y.view(x.shape),), (rmax, rinv)


def _split_backward(grads, saved, x, grad_mask):
    n = x.shape[-1]
    return [softmax_backward(_as_rows(grads[0], n), _as_rows(x, n), saved[0], saved[1]).view(x.shape)]


softmax.split = Split(forward=_split_forward, backward=_split_backward)  # type: ignore[attr-defined]
