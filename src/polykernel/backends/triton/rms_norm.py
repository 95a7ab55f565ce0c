"""Triton RMSNorm: forward and backward (dX and dW), any N, any leading shape.

Forward: a [ROWS, BLOCK_N] tile per program; rows that fit one block are loaded once, longer
rows (N > MAX_FUSED_N) are walked in chunks twice (sum of squares, then normalize).
Backward: a persistent grid of G programs; each walks rows pid, pid+G, ... and keeps its share of
dW in registers, written to its own row of a [G, N] fp32 buffer that the host sums. Long rows take
two kernels: per-row dot products, then a (column block x row group) grid that writes dx and keeps
its dW slice in registers. No atomics anywhere, so the result is deterministic and the impl is
registered ``deterministic=True``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...ops.rms_norm import reference  # noqa: F401  (semantics live in the op file)
from ...spec import Split
from .._double_backward import rms_norm_grads
from .._fallback import registered
from . import _native
from ._autograd import lean_apply
from ._autograd import transforms_active as _transforms_active
from ._colsum import BLOCK_C as _COLSUM_BLOCK
from ._colsum import colsum as _colsum
from ._launch import launch
from ._rows import TL_DTYPE
from ._rows import as_rows as _as_rows
from ._rows import cdiv as _cdiv
from ._rows import contig as _contig
from ._rows import next_pow2 as _next_pow2
from ._rows import row_tile as _tile
from ._rows import sm_count as _sm_count
from ._rows import unrows as _unrows

# what this impl does not take goes to the torch impl, resolved by name on first use (polykernel.backends._fallback)
_torch_rms_norm = registered("norm.rms_norm")

MAX_FUSED_N = 16384  # one block per row up to here; beyond, a chunked two-pass walk
CHUNK_N = 4096
LONG_BWD_BLOCK_C = 4096  # columns per program in the long-row backward
# Forward kernel for rows up to MAX_FUSED_N: "tile" ([ROWS, BLOCK_N] per program) or "row" (one
# row per program, 1-D). benchmarks/kernels/kernel_variants.py A/Bs them on the GPU.
FWD_VARIANT = "tile"


# ---------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _rms_fwd_kernel(
    X,
    W,
    Y,
    RSTD,
    M,
    N,
    stride_x,
    stride_y,
    eps,
    offset,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
    LLAMA: tl.constexpr,
    STORE_RSTD: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < M
    mask = row_ok[:, None] & (cols < N)[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)
    if STORE_RSTD:  # inference needs no rstd: no buffer to allocate
        tl.store(RSTD + rows, rstd, mask=row_ok)
    w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32) + offset
    xhat = x * rstd[:, None]
    if LLAMA:
        xhat = xhat.to(Y.dtype.element_ty).to(tl.float32)
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], (xhat * w[None, :]).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rms_fwd_row_kernel(
    X, W, Y, RSTD,
    N, stride_x, stride_y,
    eps, offset,
    BLOCK_N: tl.constexpr, LLAMA: tl.constexpr, STORE_RSTD: tl.constexpr,
):  # fmt: skip
    """One row per program, 1-D: the plainest schedule (FWD_VARIANT = "row")."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    ok = cols < N
    x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    if STORE_RSTD:
        tl.store(RSTD + row, rstd)
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32) + offset
    xhat = x * rstd
    if LLAMA:
        xhat = xhat.to(Y.dtype.element_ty).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (xhat * w).to(Y.dtype.element_ty), mask=ok)


@triton.jit
def _rms_fwd_chunked_kernel(
    X,
    W,
    Y,
    RSTD,
    N,
    stride_x,
    stride_y,
    eps,
    offset,
    CHUNK: tl.constexpr,
    LLAMA: tl.constexpr,
    STORE_RSTD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    y_row = Y + row * stride_y
    cols = tl.arange(0, CHUNK)
    acc = tl.zeros([CHUNK], dtype=tl.float32)
    for start in range(0, N, CHUNK):
        x = tl.load(x_row + start + cols, mask=start + cols < N, other=0.0).to(tl.float32)
        acc += x * x
    rstd = tl.rsqrt(tl.sum(acc, axis=0) / N + eps)
    if STORE_RSTD:
        tl.store(RSTD + row, rstd)
    for start in range(0, N, CHUNK):
        m = start + cols < N
        x = tl.load(x_row + start + cols, mask=m, other=0.0).to(tl.float32)
        w = tl.load(W + start + cols, mask=m, other=0.0).to(tl.float32) + offset
        xhat = x * rstd
        if LLAMA:
            xhat = xhat.to(Y.dtype.element_ty).to(tl.float32)
        tl.store(y_row + start + cols, (xhat * w).to(Y.dtype.element_ty), mask=m)


@triton.jit
def _rms_bwd_kernel(
    X,
    W,
    DY,
    RSTD,
    DX,
    DW_PART,
    M,
    N,
    stride_x,
    stride_dy,
    stride_dx,
    offset,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
    LLAMA: tl.constexpr,
    DTYPE_OUT: tl.constexpr,
):
    pid = tl.program_id(0)
    progs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32) + offset
    dw = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    for block in range(pid, tl.cdiv(M, ROWS), progs):
        rows = tl.cast(block, tl.int64) * ROWS + tl.arange(0, ROWS)
        row_ok = rows < M
        mask = row_ok[:, None] & col_ok[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
        xhat = x * rstd[:, None]
        g = dy * w[None, :]
        if LLAMA:  # y = round(x̂) * w: the reference's cast also rounds the gradient of x̂
            dw += dy * xhat.to(DTYPE_OUT).to(tl.float32)
            g = g.to(DTYPE_OUT).to(tl.float32)
        else:
            dw += dy * xhat
        c = tl.sum(g * xhat, axis=1) / N
        dx = (g - xhat * c[:, None]) * rstd[:, None]
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
    tl.store(DW_PART + tl.cast(pid, tl.int64) * N + cols, tl.sum(dw, axis=0), mask=col_ok)


@triton.jit
def _rms_bwd_rowdot_kernel(
    X, W, DY, RSTD, C,
    N, stride_x, stride_dy,
    offset,
    CHUNK: tl.constexpr, LLAMA: tl.constexpr, DTYPE_OUT: tl.constexpr,
):  # fmt: skip
    """Long rows, backward step 1: c[row] = mean(g * x̂) with g = dy * (w + offset)."""
    row = tl.cast(tl.program_id(0), tl.int64)
    cols = tl.arange(0, CHUNK)
    acc = tl.zeros([CHUNK], dtype=tl.float32)
    for start in range(0, N, CHUNK):
        m = start + cols < N
        x = tl.load(X + row * stride_x + start + cols, mask=m, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + start + cols, mask=m, other=0.0).to(tl.float32)
        w = tl.load(W + start + cols, mask=m, other=0.0).to(tl.float32) + offset
        g = dy * w
        if LLAMA:
            g = g.to(DTYPE_OUT).to(tl.float32)
        acc += g * x
    tl.store(C + row, tl.sum(acc, axis=0) * tl.load(RSTD + row) / N)


@triton.jit
def _rms_bwd_colblock_kernel(
    X, W, DY, RSTD, C, DX, DW_PART,
    M, N, stride_x, stride_dy, stride_dx,
    offset,
    BLOCK_C: tl.constexpr, LLAMA: tl.constexpr, DTYPE_OUT: tl.constexpr,
):  # fmt: skip
    """Long rows, backward step 2: program (column block, row group) writes dx for its columns of
    rows group, group + groups, ... and keeps their dW in registers: one more read of x and dy and
    no dW traffic per row (the old single-kernel walk re-read each row and read-modify-wrote an
    fp32 dW row per row: ~18·N bytes per row against ~10·N here)."""
    cb = tl.program_id(0)
    group = tl.program_id(1)
    groups = tl.num_programs(1)
    cols = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < N
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32) + offset
    dw = tl.zeros([BLOCK_C], dtype=tl.float32)
    for row in range(group, M, groups):
        r = tl.cast(row, tl.int64)
        x = tl.load(X + r * stride_x + cols, mask=col_ok, other=0.0).to(tl.float32)
        dy = tl.load(DY + r * stride_dy + cols, mask=col_ok, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + r)
        c = tl.load(C + r)
        xhat = x * rstd
        g = dy * w
        if LLAMA:
            dw += dy * xhat.to(DTYPE_OUT).to(tl.float32)
            g = g.to(DTYPE_OUT).to(tl.float32)
        else:
            dw += dy * xhat
        tl.store(DX + r * stride_dx + cols, ((g - xhat * c) * rstd).to(DX.dtype.element_ty), mask=col_ok)
    tl.store(DW_PART + tl.cast(group, tl.int64) * N + cols, dw, mask=col_ok)


# ---------------------------------------------------------------------------------------------
# Host launchers


# Launch settings. benchmarks/kernels/sweep_rms_norm.py overrides these to measure alternatives.
TUNE = {
    "fwd_tile_elems": 4096,  # elements per program for short rows (ROWS = this // BLOCK_N)
    "fwd_warps": None,  # None: by tile size (below)
    "bwd_tile_elems": 4096,
    "bwd_warps": None,
    "bwd_programs_per_sm": 2,
    "long_bwd_programs_per_sm": 4,  # programs of the column-blocked long-row backward
}


def _programs(device: torch.device) -> int:
    """Persistent-grid size of the backward."""
    return TUNE["bwd_programs_per_sm"] * _sm_count(device)


def rms_norm_forward(
    x2: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, llama: bool, need_rstd: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """y [M, N] in x's dtype and rstd [M] fp32 (None unless ``need_rstd``: inference)."""
    m, n = x2.shape
    y = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    # Host work is on the critical path of small calls (one torch op ~2-5 us on the H200 host):
    # inference skips the rstd buffer (the kernel is told not to store it; any pointer will do).
    rstd = torch.empty(m, dtype=torch.float32, device=x2.device) if need_rstd else None
    if m == 0 or n == 0:
        return y, None if rstd is None else rstd.fill_(0)
    if n <= MAX_FUSED_N and FWD_VARIANT == "row":
        block_n = _next_pow2(n)
        launch(
            _rms_fwd_row_kernel, (m,),
            x2, weight, y, y if rstd is None else rstd, n, x2.stride(0), y.stride(0), eps, offset,
            BLOCK_N=block_n, LLAMA=llama, STORE_RSTD=need_rstd, num_warps=TUNE["fwd_warps"] or _tile(n, block_n, None)[2],
        )  # fmt: skip
    elif n <= MAX_FUSED_N:
        block_n, rows, warps = _tile(n, TUNE["fwd_tile_elems"], TUNE["fwd_warps"])
        launch(
            _rms_fwd_kernel, (_cdiv(m, rows),),
            x2, weight, y, y if rstd is None else rstd, m, n, x2.stride(0), y.stride(0), eps, offset,
            BLOCK_N=block_n, ROWS=rows, LLAMA=llama, STORE_RSTD=need_rstd, num_warps=warps,
        )  # fmt: skip
    else:
        launch(
            _rms_fwd_chunked_kernel, (m,),
            x2, weight, y, y if rstd is None else rstd, n, x2.stride(0), y.stride(0), eps, offset,
            CHUNK=CHUNK_N, LLAMA=llama, STORE_RSTD=need_rstd, num_warps=16,
        )  # fmt: skip
    return y, rstd


def rms_norm_backward(
    dy2: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, offset: float, llama: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """dx [M, N] in x's dtype and dW [N] in weight's dtype."""
    m, n = x2.shape
    dx = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    if m == 0 or n == 0:
        return dx, torch.zeros_like(weight)
    # Host work here is on the critical path of small steps (measured on the H200 host: a Triton
    # launch costs ~20 us, each extra torch op ~5-10 us), so allocate exactly and skip no-op casts.
    if n <= MAX_FUSED_N:
        block_n, rows, warps = _tile(n, TUNE["bwd_tile_elems"], TUNE["bwd_warps"])
        progs = min(_programs(x2.device), _cdiv(m, rows))
        part = torch.empty((progs, n), dtype=torch.float32, device=x2.device)  # every program writes its row
        launch(
            _rms_bwd_kernel, (progs,),
            x2, weight, dy2, rstd, dx, part, m, n, x2.stride(0), dy2.stride(0), dx.stride(0), offset,
            BLOCK_N=block_n, ROWS=rows, LLAMA=llama, DTYPE_OUT=TL_DTYPE[x2.dtype], num_warps=warps,
        )  # fmt: skip
    else:  # long rows: row dot products, then a column-blocked dx/dW pass
        c = torch.empty(m, dtype=torch.float32, device=x2.device)
        launch(
            _rms_bwd_rowdot_kernel, (m,),
            x2, weight, dy2, rstd, c, n, x2.stride(0), dy2.stride(0), offset,
            CHUNK=CHUNK_N, LLAMA=llama, DTYPE_OUT=TL_DTYPE[x2.dtype], num_warps=16,
        )  # fmt: skip
        blocks = _cdiv(n, LONG_BWD_BLOCK_C)
        groups = max(1, min(m, _cdiv(TUNE["long_bwd_programs_per_sm"] * _sm_count(x2.device), blocks)))
        part = torch.empty((groups, n), dtype=torch.float32, device=x2.device)  # (group, block) pairs cover it
        launch(
            _rms_bwd_colblock_kernel, (blocks, groups),
            x2, weight, dy2, rstd, c, dx, part, m, n, x2.stride(0), dy2.stride(0), dx.stride(0), offset,
            BLOCK_C=LONG_BWD_BLOCK_C, LLAMA=llama, DTYPE_OUT=TL_DTYPE[x2.dtype], num_warps=8,
        )  # fmt: skip
    return dx, _colsum(part, weight.dtype)  # one launch for part.sum(0).to(dtype): two host ops


# ---------------------------------------------------------------------------------------------
# Registered impl


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, offset, casting):  # type: ignore[override]
        shape = x.shape
        x2 = _as_rows(x, shape[-1])
        w = _contig(weight)
        llama = casting == "llama"
        y, rstd = rms_norm_forward(x2, w, eps, offset, llama)
        # x and weight themselves as well where x2 / w are other tensors (made here, without a
        # graph): a create_graph backward differentiates through the inputs
        if x2 is x and w is weight:
            ctx.save_for_backward(x2, w, rstd)
        else:
            ctx.save_for_backward(x2, w, rstd, x, weight)
        ctx.eps, ctx.offset, ctx.casting, ctx.llama, ctx.shape = eps, offset, casting, llama, shape
        return _unrows(y, shape)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x2, w, rstd, *inputs = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: differentiable gradients, by the torch formula
            x, weight = inputs or (x2, w)
            return (*rms_norm_grads(x, weight, ctx.eps, ctx.offset, ctx.casting, dy, ctx.needs_input_grad), None, None, None)
        dx, dw = rms_norm_backward(_as_rows(dy, x2.shape[1]), x2, w, rstd, ctx.offset, ctx.llama)
        need = ctx.needs_input_grad
        return (
            _unrows(dx, ctx.shape) if need[0] else None,
            dw if need[1] else None,
            None,
            None,
            None,
        )


_lean_apply = lean_apply(_RMSNorm)  # _RMSNorm.apply without its Python wrapper (see _autograd.py)


class _NativePlan:
    """The C++ path's plan for one (dtypes, N, casting, device): its slots and tile numbers."""

    def __init__(self, x: torch.Tensor, w: torch.Tensor, llama: bool) -> None:
        n = x.shape[-1]
        block_n, self.rows_fwd, warps = _tile(n, TUNE["fwd_tile_elems"], TUNE["fwd_warps"])
        fwd = dict(BLOCK_N=block_n, ROWS=self.rows_fwd, LLAMA=llama, num_warps=warps)
        self.fwd = _native.slot(_rms_fwd_kernel, STORE_RSTD=True, **fwd)
        self.fwd_infer = _native.slot(_rms_fwd_kernel, STORE_RSTD=False, **fwd)
        block_n, self.rows_bwd, warps = _tile(n, TUNE["bwd_tile_elems"], TUNE["bwd_warps"])
        self.bwd = _native.slot(
            _rms_bwd_kernel, BLOCK_N=block_n, ROWS=self.rows_bwd, LLAMA=llama, DTYPE_OUT=TL_DTYPE[x.dtype], num_warps=warps
        )
        self.programs = _programs(x.device)
        self.colsum = _native.colsum_slot()
        self.colsum_block = _COLSUM_BLOCK


def _native_plan(x: torch.Tensor, weight: torch.Tensor, llama: bool) -> _NativePlan | None:
    """Rows that fit one tile and the tile forward: the shapes the C++ path mirrors."""
    takes = x.shape[-1] <= MAX_FUSED_N and FWD_VARIANT == "tile" and weight.dtype in TL_DTYPE and x.dtype in TL_DTYPE
    return _NativePlan(x, weight, llama) if takes else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, casting: str) -> torch.Tensor:
    """The registered impl (arguments already validated by ``polykernel.rms_norm``)."""
    if _native.ENABLED:
        llama = casting == "llama"
        y = _native.call("rms_norm", (x, weight, eps, offset, llama), (x, weight, llama), _native_plan)
        if y is not None:
            return y
    if _transforms_active():  # functorch (vmap, grad): the kernels cannot read its wrapped tensors
        return _torch_rms_norm(x, weight, eps, offset, casting)
    if (x.requires_grad or weight.requires_grad) and torch.is_grad_enabled():
        return _lean_apply(x, weight, eps, offset, casting)
    shape = x.shape
    y, _ = rms_norm_forward(_as_rows(x, shape[-1]), _contig(weight), eps, offset, casting == "llama", need_rstd=False)
    return _unrows(y, shape)


# Forward and backward as separate functions, for compiled graphs (polykernel.compile.library): the
# backward runs on the saved rstd, no recompute. Saved layout: the torch impl's (rstd fp32 [M]).
def _split_forward(x, weight, eps, offset, casting, grad_mask):
    y, rstd = rms_norm_forward(_as_rows(x, x.shape[-1]), weight.contiguous(), eps, offset, casting == "llama")
    return (y.view(x.shape),), (rstd,)


def _split_backward(grads, saved, x, weight, eps, offset, casting, grad_mask):
    n = x.shape[-1]
    dx, dw = rms_norm_backward(_as_rows(grads[0], n), _as_rows(x, n), weight.contiguous(), saved[0], offset, casting == "llama")
    return [dx.view(x.shape), dw, None, None, None]


rms_norm.split = Split(forward=_split_forward, backward=_split_backward)  # type: ignore[attr-defined]
