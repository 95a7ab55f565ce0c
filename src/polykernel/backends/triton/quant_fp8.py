"""Triton fp8 (e4m3) quantisation kernels of the serving ops: static, dynamic per token and per
tensor, and RMSNorm fused with a static scale.

``q = clamp(v / scale, -448, 448)`` in fp32 (NaN kept), rounded to ``float8e4nv`` by the store's
conversion (nearest even, saturating-free: the clamp comes first). Rows are addressed through their
row stride ([M, N] views, unit column stride), offsets in int64. Kernels:

- ``_static_kernel``: elementwise [ROWS, BLOCK] tiles; the scale per row (stride 1) or one for
  all (stride 0), loaded once per row of the tile;
- ``_token_kernel``: per row, amax -> scale = max(amax / 448, 1e-12) -> quantise; the row stays in
  registers up to MAX_FUSED_N, longer rows are walked twice (amax, then quantise);
- ``_amax_kernel``: per tile, the per-tensor scale candidate, merged with an integer ``atomic_max``
  on the scale's bits (non-negative floats order like their int32 bits, and a canonical NaN is
  above every one of them: deterministic, NaN-propagating); ``_static_kernel`` then quantises;
- ``_rms_norm_quant_kernel``: RMSNorm (fp32, weighted) and quantise in one pass per row block
  (two walks past MAX_FUSED_N).

A row's NaN is carried explicitly (``tl.max`` does not promise to propagate it). No allocation
beyond the outputs (the per-tensor scale is zeroed in place): CUDA-graph safe.

Triton's CPU interpreter (3.9) rounds fp32 -> float8e4nv wrongly: a mantissa carry into the next
binade is dropped (127.99 -> 64) and subnormals truncate. On CPU tensors (only ever the
interpreter) the kernels therefore store the clamped fp32 quotient into a scratch tensor that
torch rounds to e4m3; on the GPU they store e4m3 themselves. Everything but that one conversion
runs the same code.

Contiguous x and outputs on the GPU launch from C++ when the native path is on (one
:class:`_NativePlan` per row length serves the three ops).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _native
from ._launch import launch
from ._rows import as_rows as _as_rows
from ._rows import cdiv as _cdiv
from ._rows import contig as _contig
from ._rows import next_pow2 as _next_pow2
from ._rows import row_tile as _row_tile
from .glu import _row_view

FP8_MAX = tl.constexpr(448.0)
SCALE_FLOOR = tl.constexpr(1e-12)
MAX_FUSED_N = 16384  # a row in registers up to here; beyond, two walks over it
CHUNK_N = 4096
TILE = 4096  # elements per program


# ---------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _quant(v, s):
    """clamp(v / s, ±448) in fp32, NaN kept."""
    return tl.clamp(v / s, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _row_amax(a, x, axis: tl.constexpr):
    """max |x| along ``axis`` of the masked-to-zero tile ``x`` (a = |x|), NaN if any is NaN."""
    m = tl.max(a, axis=axis)
    nan = tl.max((x != x).to(tl.int32), axis=axis) > 0
    return tl.where(nan, float("nan"), m)


@triton.jit
def _scale_of(amax):
    s = tl.maximum(amax / FP8_MAX, SCALE_FLOOR)
    return tl.where(amax != amax, float("nan"), s)


@triton.jit
def _static_kernel(
    X, S, Q, M, N, col_blocks, stride_x, stride_q, stride_s,
    BLOCK: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    rb = pid // col_blocks
    rows = tl.cast(rb, tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.cast(pid - rb * col_blocks, tl.int64) * BLOCK + tl.arange(0, BLOCK)
    row_ok = rows < M
    mask = row_ok[:, None] & (cols < N)[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    s = tl.load(S + rows * stride_s, mask=row_ok, other=1.0)
    tl.store(Q + rows[:, None] * stride_q + cols[None, :], _quant(x, s[:, None]).to(Q.dtype.element_ty), mask=mask)


@triton.jit
def _token_kernel(
    X, Q, S, M, N, stride_x, stride_q,
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr, CHUNKED: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < M
    cols = tl.arange(0, BLOCK_N)
    if CHUNKED:  # ROWS == 1: amax over the row in chunks, then quantise it chunk by chunk
        amax = tl.zeros([ROWS], dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            mask = row_ok[:, None] & (start + cols < N)[None, :]
            x = tl.load(X + rows[:, None] * stride_x + (start + cols)[None, :], mask=mask, other=0.0).to(tl.float32)
            a = _row_amax(tl.abs(x), x, 1)
            amax = tl.where((a != a) | (amax != amax), float("nan"), tl.maximum(amax, a))
        s = _scale_of(amax)
        tl.store(S + rows, s, mask=row_ok)
        for start in range(0, N, BLOCK_N):
            mask = row_ok[:, None] & (start + cols < N)[None, :]
            x = tl.load(X + rows[:, None] * stride_x + (start + cols)[None, :], mask=mask, other=0.0).to(tl.float32)
            q = _quant(x, s[:, None])
            tl.store(Q + rows[:, None] * stride_q + (start + cols)[None, :], q.to(Q.dtype.element_ty), mask=mask)
    else:
        mask = row_ok[:, None] & (cols < N)[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        s = _scale_of(_row_amax(tl.abs(x), x, 1))
        tl.store(S + rows, s, mask=row_ok)
        tl.store(Q + rows[:, None] * stride_q + cols[None, :], _quant(x, s[:, None]).to(Q.dtype.element_ty), mask=mask)


@triton.jit
def _amax_kernel(
    X, S_BITS, M, N, col_blocks, stride_x,
    BLOCK: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    rb = pid // col_blocks
    rows = tl.cast(rb, tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.cast(pid - rb * col_blocks, tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    amax = _row_amax(tl.reshape(tl.abs(x), [ROWS * BLOCK]), tl.reshape(x, [ROWS * BLOCK]), 0)
    s = _scale_of(amax)
    s = tl.where(s != s, float("nan"), s)  # one canonical (positive) NaN, above every finite bit pattern
    tl.atomic_max(S_BITS, s.to(tl.int32, bitcast=True))


@triton.jit
def _rms_norm_quant_kernel(
    X, W, S, Q, M, N, stride_x, stride_q, stride_s, eps,
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr, CHUNKED: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < M
    cols = tl.arange(0, BLOCK_N)
    s = tl.load(S + rows * stride_s, mask=row_ok, other=1.0)[:, None]
    if CHUNKED:  # ROWS == 1: sum of squares in chunks, then normalise and quantise chunk by chunk
        acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            mask = row_ok[:, None] & (start + cols < N)[None, :]
            x = tl.load(X + rows[:, None] * stride_x + (start + cols)[None, :], mask=mask, other=0.0).to(tl.float32)
            acc += x * x
        rstd = tl.rsqrt(tl.sum(acc, axis=1) / N + eps)[:, None]
        for start in range(0, N, BLOCK_N):
            c = start + cols
            mask = row_ok[:, None] & (c < N)[None, :]
            x = tl.load(X + rows[:, None] * stride_x + c[None, :], mask=mask, other=0.0).to(tl.float32)
            w = tl.load(W + c, mask=c < N, other=0.0).to(tl.float32)[None, :]
            tl.store(Q + rows[:, None] * stride_q + c[None, :], _quant(x * rstd * w, s).to(Q.dtype.element_ty), mask=mask)
    else:
        mask = row_ok[:, None] & (cols < N)[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)[:, None]
        w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        tl.store(Q + rows[:, None] * stride_q + cols[None, :], _quant(x * rstd * w, s).to(Q.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------
# Host launchers


def _target(q: torch.Tensor, n: int) -> tuple[torch.Tensor, bool]:
    """The [M, N] tensor the kernels store into, and whether it must be copied into ``q`` after:
    ``q``'s own rows on the GPU; an fp32 scratch on CPU tensors (the interpreter's fp8
    conversion is wrong: see the module doc) or where ``q`` has no row view."""
    q2 = _row_view(q, n) if q.device.type != "cpu" else None
    if q2 is not None:
        return q2, False
    dtype = torch.float32 if q.device.type == "cpu" else q.dtype
    return torch.empty((q.numel() // n, n), dtype=dtype, device=q.device), True


def _finish(q: torch.Tensor, target: torch.Tensor, copy: bool) -> torch.Tensor:
    if copy:
        q.copy_(target.view(q.shape))  # torch rounds fp32 -> e4m3 to nearest even
    return q


def _elementwise_tiles(m: int, n: int) -> tuple[int, int, int, int]:
    """(BLOCK, ROWS, col_blocks, num_warps) of TILE-element programs."""
    block = min(TILE, _next_pow2(max(n, 1)))
    rows = min(max(1, TILE // block), _next_pow2(max(m, 1)))
    return block, rows, _cdiv(n, block), max(1, min(8, block * rows // 512))


def _row_tiles(n: int) -> tuple[int, int, int, bool]:
    """(BLOCK_N, ROWS, num_warps, CHUNKED) of the row kernels (per token, RMSNorm): whole rows in
    registers up to MAX_FUSED_N, else one row per program in chunks."""
    if n <= MAX_FUSED_N:
        block_n, rows, warps = _row_tile(n, TILE, None)
        return block_n, rows, warps, False
    return CHUNK_N, 1, 8, True


def _scale_rows(scale: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The scale as a flat tensor and its per-row stride (0: one scale for every row)."""
    if scale.numel() == 1:
        return scale, 0
    s = scale.reshape(-1)
    return s, s.stride(0)


def static_quant(x: torch.Tensor, scale: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """q <- clamp(x / scale) (arguments validated by the op)."""
    if _native.ENABLED and _native.call("static_quant_fp8", (x, scale, q), (x,), _native_plan) is not None:
        return q
    n = x.shape[-1] if x.dim() else 1
    if q.numel() == 0:
        return q
    x2 = _as_rows(x, n)
    target, copy = _target(q, n)
    s, stride_s = _scale_rows(scale)
    m = x2.shape[0]
    block, rows, col_blocks, warps = _elementwise_tiles(m, n)
    launch(
        _static_kernel, (_cdiv(m, rows) * col_blocks,),
        x2, s, target, m, n, col_blocks, x2.stride(0), target.stride(0), stride_s,
        BLOCK=block, ROWS=rows, num_warps=warps,
    )  # fmt: skip
    return _finish(q, target, copy)


def dynamic_quant(x: torch.Tensor, per_token: bool, q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) <- x quantised with its own scale per row or per tensor (validated by the op)."""
    if _native.ENABLED and _native.call("dynamic_quant_fp8", (x, per_token, q, scale), (x,), _native_plan) is not None:
        return q, scale
    n = x.shape[-1]
    if not per_token:
        scale.zero_()  # the atomic max's start (0.0 has bits 0); stays the floor's 0 only for an empty x
        if x.numel() == 0:
            scale.fill_(float(SCALE_FLOOR.value))
            return q, scale
        x2 = _as_rows(x, n)
        m = x2.shape[0]
        block, rows, col_blocks, warps = _elementwise_tiles(m, n)
        launch(
            _amax_kernel, (_cdiv(m, rows) * col_blocks,),
            x2, scale.view(torch.int32), m, n, col_blocks, x2.stride(0),
            BLOCK=block, ROWS=rows, num_warps=warps,
        )  # fmt: skip
        return static_quant(x, scale, q), scale
    if x.numel() == 0:
        if scale.numel():
            scale.fill_(float(SCALE_FLOOR.value))  # rows of no elements: amax 0
        return q, scale
    x2 = _as_rows(x, n)
    m = x2.shape[0]
    target, copy = _target(q, n)
    s = scale.view(-1)
    block_n, rows, warps, chunked = _row_tiles(n)
    launch(
        _token_kernel, (_cdiv(m, rows),),
        x2, target, s, m, n, x2.stride(0), target.stride(0),
        BLOCK_N=block_n, ROWS=rows, CHUNKED=chunked, num_warps=warps,
    )  # fmt: skip
    return _finish(q, target, copy), scale


def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, eps: float, q: torch.Tensor) -> torch.Tensor:
    """q <- clamp(rms_norm(x, weight, eps) / scale) (arguments validated by the op)."""
    if _native.ENABLED and _native.call("rms_norm_quant_fp8", (x, weight, scale, eps, q), (x,), _native_plan) is not None:
        return q
    n = x.shape[-1]
    if q.numel() == 0:
        return q
    x2 = _as_rows(x, n)
    m = x2.shape[0]
    target, copy = _target(q, n)
    s, stride_s = _scale_rows(scale)
    block_n, rows, warps, chunked = _row_tiles(n)
    launch(
        _rms_norm_quant_kernel, (_cdiv(m, rows),),
        x2, _contig(weight), s, target, m, n, x2.stride(0), target.stride(0), stride_s, eps,
        BLOCK_N=block_n, ROWS=rows, CHUNKED=chunked, num_warps=warps,
    )  # fmt: skip
    return _finish(q, target, copy)


# ---------------------------------------------------------------------------------------------
# The native path's plan


def _elementwise_tile(kernel: object, m: int, n: int) -> _native.RowTile:
    """An elementwise kernel's slot for m rows of n."""
    block, rows, _, warps = _elementwise_tiles(m, n)
    return _native.RowTile(_native.slot(kernel, BLOCK=block, ROWS=rows, num_warps=warps), rows)


class _NativePlan:
    """The C++ path's plan for rows of n (contiguous x and outputs), shared by the three ops: the
    elementwise kernels' tiles per power of two of M up to their largest ROWS (TILE // BLOCK),
    the row kernels' one tile."""

    def __init__(self, n: int) -> None:
        self.block = _elementwise_tiles(1, n)[0]
        most = TILE // self.block
        self.quant = _native.row_tiles(most, lambda m: _elementwise_tile(_static_kernel, m, n))
        self.amax = _native.row_tiles(most, lambda m: _elementwise_tile(_amax_kernel, m, n))
        block_n, rows, warps, chunked = _row_tiles(n)
        self.token_rows = self.rms_rows = rows
        self.token = _native.slot(_token_kernel, BLOCK_N=block_n, ROWS=rows, CHUNKED=chunked, num_warps=warps)
        self.rms = _native.slot(_rms_norm_quant_kernel, BLOCK_N=block_n, ROWS=rows, CHUNKED=chunked, num_warps=warps)


def _native_plan(x: torch.Tensor) -> _NativePlan | None:
    n = x.shape[-1] if x.dim() else 0
    return _NativePlan(n) if n > 0 else None
