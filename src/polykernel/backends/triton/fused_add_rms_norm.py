"""Triton fused add + RMSNorm: forward and backward (d(x) = d(residual), dW), any N, any leading shape.

Forward, one pass over memory: read x and residual, write s = x + residual (rounded to x's dtype,
as PyTorch rounds it) and y = rms_norm(s); a [ROWS, BLOCK_N] tile per program. Longer rows
(N > MAX_FUSED_N) are walked in chunks twice: sum of squares of the rounded s (storing s), then
normalize (re-adding x + residual, which rounds to the same s).
Backward: d(s) = d(s_out) + rstd·(g - ŝ·mean(g·ŝ)), g = dy·(w + offset), from the saved s and
rstd; one tensor is the gradient of both x and residual. dW as in the rms_norm Triton backward:
a persistent grid, each program's share kept in registers (or, for long rows, in its own row of a
[G, N] fp32 buffer) and summed on the host: no atomics, deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...ops.fused_add_rms_norm import reference  # noqa: F401  (semantics live in the op file)
from .._double_backward import fused_add_rms_norm_grads
from .._fallback import registered
from . import _native
from ._autograd import lean_apply
from ._autograd import transforms_active as _transforms_active
from ._colsum import BLOCK_C as _COLSUM_BLOCK
from ._colsum import colsum as _colsum
from ._launch import launch
from ._rows import as_rows as _as_rows
from ._rows import cdiv as _cdiv
from ._rows import contig as _contig
from ._rows import row_tile as _tile
from ._rows import sm_count as _sm_count
from ._rows import unrows as _unrows

# what this impl does not take goes to the torch impl, resolved by name on first use (polykernel.backends._fallback)
_torch_fused_add_rms_norm = registered("norm.fused_add_rms_norm")

MAX_FUSED_N = 16384  # one block per row up to here; beyond, a chunked walk
CHUNK_N = 4096

# ---------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _add_rms_fwd_kernel(
    X, R, W, Y, S, RSTD,
    M, N, stride_x, stride_r, stride_y, stride_s,
    eps, offset,
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr, STORE_RSTD: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < M
    mask = row_ok[:, None] & (cols < N)[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    r = tl.load(R + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    s = (x + r).to(S.dtype.element_ty)  # the exact sum of two x.dtype values, rounded once: PyTorch's x + r
    tl.store(S + rows[:, None] * stride_s + cols[None, :], s, mask=mask)
    sf = s.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(sf * sf, axis=1) / N + eps)
    if STORE_RSTD:  # inference needs no rstd: no buffer to allocate
        tl.store(RSTD + rows, rstd, mask=row_ok)
    w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32) + offset
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], (sf * rstd[:, None] * w[None, :]).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _add_rms_fwd_chunked_kernel(
    X, R, W, Y, S, RSTD,
    N, stride_x, stride_r, stride_y, stride_s,
    eps, offset,
    CHUNK: tl.constexpr, STORE_RSTD: tl.constexpr, S_IS_R: tl.constexpr = False,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    r_row = R + row * stride_r
    s_row = S + row * stride_s
    y_row = Y + row * stride_y
    cols = tl.arange(0, CHUNK)
    acc = tl.zeros([CHUNK], dtype=tl.float32)
    for start in range(0, N, CHUNK):
        m = start + cols < N
        x = tl.load(x_row + start + cols, mask=m, other=0.0).to(tl.float32)
        r = tl.load(r_row + start + cols, mask=m, other=0.0).to(tl.float32)
        s = (x + r).to(S.dtype.element_ty)
        tl.store(s_row + start + cols, s, mask=m)
        sf = s.to(tl.float32)
        acc += sf * sf
    rstd = tl.rsqrt(tl.sum(acc, axis=0) / N + eps)
    if STORE_RSTD:
        tl.store(RSTD + row, rstd)
    if S_IS_R:  # in place (residual <- s): R holds s now, so s is read back (after every thread's store)
        tl.debug_barrier()
    for start in range(0, N, CHUNK):
        m = start + cols < N
        if S_IS_R:
            sf = tl.load(s_row + start + cols, mask=m, other=0.0).to(tl.float32)
        else:
            x = tl.load(x_row + start + cols, mask=m, other=0.0).to(tl.float32)
            r = tl.load(r_row + start + cols, mask=m, other=0.0).to(tl.float32)
            sf = (x + r).to(S.dtype.element_ty).to(tl.float32)
        w = tl.load(W + start + cols, mask=m, other=0.0).to(tl.float32) + offset
        tl.store(y_row + start + cols, (sf * rstd * w).to(Y.dtype.element_ty), mask=m)


@triton.jit
def _add_rms_bwd_kernel(
    S, W, DY, DS_OUT, RSTD, DS, DW_PART,
    M, N, stride_s, stride_dy, stride_dso, stride_ds,
    offset,
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr, HAS_DS_OUT: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    progs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    dw = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    for block in range(pid, tl.cdiv(M, ROWS), progs):
        rows = tl.cast(block, tl.int64) * ROWS + tl.arange(0, ROWS)
        row_ok = rows < M
        mask = row_ok[:, None] & col_ok[None, :]
        s = tl.load(S + rows[:, None] * stride_s + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
        w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32) + offset  # L1-resident; frees registers
        shat = s * rstd[:, None]
        g = dy * w[None, :]
        dw += dy * shat
        c = tl.sum(g * shat, axis=1) / N
        ds = (g - shat * c[:, None]) * rstd[:, None]
        if HAS_DS_OUT:
            ds += tl.load(DS_OUT + rows[:, None] * stride_dso + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(DS + rows[:, None] * stride_ds + cols[None, :], ds.to(DS.dtype.element_ty), mask=mask)
    tl.store(DW_PART + tl.cast(pid, tl.int64) * N + cols, tl.sum(dw, axis=0), mask=col_ok)


@triton.jit
def _add_rms_bwd_chunked_kernel(
    S, W, DY, DS_OUT, RSTD, DS, DW_PART,
    M, N, stride_s, stride_dy, stride_dso, stride_ds,
    offset,
    CHUNK: tl.constexpr, HAS_DS_OUT: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    progs = tl.num_programs(0)
    cols = tl.arange(0, CHUNK)
    part = DW_PART + tl.cast(pid, tl.int64) * N  # this program's own row: read-modify-write, no atomics
    for row in range(pid, M, progs):
        row64 = tl.cast(row, tl.int64)
        rstd = tl.load(RSTD + row64)
        acc = tl.zeros([CHUNK], dtype=tl.float32)
        for start in range(0, N, CHUNK):
            m = start + cols < N
            s = tl.load(S + row64 * stride_s + start + cols, mask=m, other=0.0).to(tl.float32)
            dy = tl.load(DY + row64 * stride_dy + start + cols, mask=m, other=0.0).to(tl.float32)
            w = tl.load(W + start + cols, mask=m, other=0.0).to(tl.float32) + offset
            acc += dy * w * s
        c = tl.sum(acc, axis=0) * rstd / N
        for start in range(0, N, CHUNK):
            m = start + cols < N
            s = tl.load(S + row64 * stride_s + start + cols, mask=m, other=0.0).to(tl.float32)
            dy = tl.load(DY + row64 * stride_dy + start + cols, mask=m, other=0.0).to(tl.float32)
            w = tl.load(W + start + cols, mask=m, other=0.0).to(tl.float32) + offset
            shat = s * rstd
            ds = (dy * w - shat * c) * rstd
            if HAS_DS_OUT:
                ds += tl.load(DS_OUT + row64 * stride_dso + start + cols, mask=m, other=0.0).to(tl.float32)
            tl.store(DS + row64 * stride_ds + start + cols, ds.to(DS.dtype.element_ty), mask=m)
            prev = tl.load(part + start + cols, mask=m, other=0.0)
            tl.store(part + start + cols, prev + dy * shat, mask=m)


# ---------------------------------------------------------------------------------------------
# Host launchers

# Launch settings (a sweep may override them to measure alternatives).
TUNE = {
    "fwd_tile_elems": 4096,  # elements per program for short rows (ROWS = this // BLOCK_N)
    "fwd_warps": None,  # None: by tile size (see _tile)
    "bwd_tile_elems": 4096,
    "bwd_warps": 16,  # faster fwd+bwd at 16384x4096 than warps by tile size (benchmarks/results/h200-2026-11-30-kernel-variants/)
    "bwd_programs_per_sm": 2,  # persistent grid of the backward
}


def _programs(device: torch.device) -> int:
    """Persistent-grid size of the backward (4 on the CPU interpreter: several partials)."""
    return TUNE["bwd_programs_per_sm"] * _sm_count(device)


def fused_add_rms_norm_forward(
    x2: torch.Tensor, r2: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, need_rstd: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """y [M, N] and s [M, N] in x's dtype, rstd [M] fp32 (None unless ``need_rstd``: inference;
    x2, r2: [M, N], unit column stride)."""
    m, n = x2.shape
    y = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    s = torch.empty((m, n), dtype=x2.dtype, device=x2.device)  # its own storage: saved for backward alone
    rstd = torch.empty(m, dtype=torch.float32, device=x2.device) if need_rstd else None
    forward_into(x2, r2, weight, y, s, rstd, eps, offset)
    return y, s, rstd


def forward_into(
    x2: torch.Tensor,
    r2: torch.Tensor,
    weight: torch.Tensor,
    y2: torch.Tensor,
    s2: torch.Tensor,
    rstd: torch.Tensor | None,
    eps: float,
    offset: float,
) -> None:
    """Write s = x + residual into s2 and rms_norm(s) into y2 (all [M, N], unit column stride,
    each with its own row stride); rstd [M] fp32 too unless None. One launch. ``y2`` may be
    ``x2`` and ``s2`` may be ``r2`` (in place: the serving layout's fused_add_rms_norm_): each
    program reads its rows before it writes them, and the chunked walk then reads s back."""
    m, n = x2.shape
    if m == 0 or n == 0:
        return
    r = y2 if rstd is None else rstd  # never written without STORE_RSTD
    if n <= MAX_FUSED_N:
        block_n, rows, warps = _tile(n, TUNE["fwd_tile_elems"], TUNE["fwd_warps"])
        launch(
            _add_rms_fwd_kernel, (_cdiv(m, rows),),
            x2, r2, weight, y2, s2, r, m, n, x2.stride(0), r2.stride(0), y2.stride(0), s2.stride(0), eps, offset,
            BLOCK_N=block_n, ROWS=rows, STORE_RSTD=rstd is not None, num_warps=warps,
        )  # fmt: skip
    elif s2.data_ptr() == r2.data_ptr():
        launch(
            _add_rms_fwd_chunked_kernel, (m,),
            x2, r2, weight, y2, s2, r, n, x2.stride(0), r2.stride(0), y2.stride(0), s2.stride(0), eps, offset,
            CHUNK=CHUNK_N, STORE_RSTD=rstd is not None, S_IS_R=True, num_warps=16,
        )  # fmt: skip
    else:
        launch(
            _add_rms_fwd_chunked_kernel, (m,),
            x2, r2, weight, y2, s2, r, n, x2.stride(0), r2.stride(0), y2.stride(0), s2.stride(0), eps, offset,
            CHUNK=CHUNK_N, STORE_RSTD=rstd is not None, num_warps=16,
        )  # fmt: skip


def fused_add_rms_norm_backward(
    dy2: torch.Tensor, ds_out2: torch.Tensor | None, s2: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, offset: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """d(s) [M, N] in s's dtype (``ds_out2`` added when given) and dW [N] in weight's dtype."""
    m, n = s2.shape
    dev = s2.device
    ds = torch.empty((m, n), dtype=s2.dtype, device=dev)
    if m == 0 or n == 0:
        return ds, torch.zeros_like(weight)
    has_dso = ds_out2 is not None
    dso = ds_out2 if has_dso else dy2  # never read without HAS_DS_OUT
    progs = min(_programs(dev), m)
    if n <= MAX_FUSED_N:
        block_n, rows, warps = _tile(n, TUNE["bwd_tile_elems"], TUNE["bwd_warps"])
        progs = min(progs, _cdiv(m, rows))
        part = torch.empty((progs, n), dtype=torch.float32, device=dev)
        launch(
            _add_rms_bwd_kernel, (progs,),
            s2, weight, dy2, dso, rstd, ds, part, m, n, s2.stride(0), dy2.stride(0), dso.stride(0), ds.stride(0), offset,
            BLOCK_N=block_n, ROWS=rows, HAS_DS_OUT=has_dso, num_warps=warps,
        )  # fmt: skip
    else:
        part = torch.zeros((progs, n), dtype=torch.float32, device=dev)  # accumulated into: starts at zero
        launch(
            _add_rms_bwd_chunked_kernel, (progs,),
            s2, weight, dy2, dso, rstd, ds, part, m, n, s2.stride(0), dy2.stride(0), dso.stride(0), ds.stride(0), offset,
            CHUNK=CHUNK_N, HAS_DS_OUT=has_dso, num_warps=16,
        )  # fmt: skip
    return ds, _colsum(part, weight.dtype)  # one launch for part.sum(0).to(dtype): two host ops


# ---------------------------------------------------------------------------------------------
# Registered impl


class _FusedAddRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, eps, offset):  # type: ignore[override]
        shape = x.shape
        n = shape[-1]
        w = _contig(weight)
        y, s, rstd = fused_add_rms_norm_forward(_as_rows(x, n), _as_rows(residual, n), w, eps, offset)
        s_out = _unrows(s, shape)
        # The output s_out and weight themselves as well where they differ from s / w: a
        # create_graph backward differentiates through them (s_out, an output, carries the graph
        # back to x and residual through this node).
        if s_out is s and w is weight:
            ctx.save_for_backward(s, w, rstd)
        else:
            ctx.save_for_backward(s, w, rstd, s_out, weight)
        ctx.eps, ctx.offset, ctx.shape = eps, offset, shape
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no zeros read
        return _unrows(y, shape), s_out

    @staticmethod
    def backward(ctx, dy, ds_out):  # type: ignore[override]
        s2, w, rstd, *outputs = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: differentiable gradients, by the torch formula
            s, weight = outputs or (s2, w)
            return (*fused_add_rms_norm_grads(s, weight, ctx.eps, ctx.offset, dy, ds_out, ctx.needs_input_grad), None, None)
        n = s2.shape[1]
        if dy is None:  # only the new residual was used: y contributes nothing
            ds, dw = ds_out, None
        else:
            ds2, dw = fused_add_rms_norm_backward(_as_rows(dy, n), None if ds_out is None else _as_rows(ds_out, n), s2, w, rstd, ctx.offset)
            ds = _unrows(ds2, ctx.shape)
        need = ctx.needs_input_grad
        return ds if need[0] else None, ds if need[1] else None, dw if need[2] else None, None, None


_lean_apply = lean_apply(_FusedAddRMSNorm)  # _FusedAddRMSNorm.apply without its Python wrapper (see _autograd.py)


class _NativePlan:
    """The C++ path's plan for one (dtypes, N, device): its slots and tile numbers."""

    def __init__(self, x: torch.Tensor) -> None:
        n = x.shape[-1]
        block_n, self.rows_fwd, warps = _tile(n, TUNE["fwd_tile_elems"], TUNE["fwd_warps"])
        self.fwd = _native.slot(_add_rms_fwd_kernel, BLOCK_N=block_n, ROWS=self.rows_fwd, STORE_RSTD=True, num_warps=warps)
        self.fwd_infer = _native.slot(_add_rms_fwd_kernel, BLOCK_N=block_n, ROWS=self.rows_fwd, STORE_RSTD=False, num_warps=warps)
        block_n, self.rows_bwd, warps = _tile(n, TUNE["bwd_tile_elems"], TUNE["bwd_warps"])
        self.bwd = _native.slot(_add_rms_bwd_kernel, BLOCK_N=block_n, ROWS=self.rows_bwd, HAS_DS_OUT=False, num_warps=warps)
        self.bwd_dso = _native.slot(_add_rms_bwd_kernel, BLOCK_N=block_n, ROWS=self.rows_bwd, HAS_DS_OUT=True, num_warps=warps)
        self.programs = _programs(x.device)
        self.colsum = _native.colsum_slot()
        self.colsum_block = _COLSUM_BLOCK


def _native_plan(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> _NativePlan | None:
    """Rows that fit one tile: the shapes the C++ path mirrors."""
    return _NativePlan(x) if x.shape[-1] <= MAX_FUSED_N else None


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The registered impl (arguments already validated by ``polykernel.fused_add_rms_norm``)."""
    if _native.ENABLED:
        out = _native.call("fused_add_rms_norm", (x, residual, weight, eps, offset), (x, residual, weight), _native_plan)
        if out is not None:
            return out
    if _transforms_active():  # functorch (vmap, grad): the kernels cannot read its wrapped tensors
        return _torch_fused_add_rms_norm(x, residual, weight, eps, offset)
    if (x.requires_grad or residual.requires_grad or weight.requires_grad) and torch.is_grad_enabled():
        return _lean_apply(x, residual, weight, eps, offset)
    shape = x.shape
    n = shape[-1]
    y, s, _ = fused_add_rms_norm_forward(_as_rows(x, n), _as_rows(residual, n), _contig(weight), eps, offset, need_rstd=False)
    return _unrows(y, shape), _unrows(s, shape)
