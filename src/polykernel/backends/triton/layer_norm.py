"""Triton LayerNorm: forward and backward (dX, dW, dB), any N, any leading shape.

Forward: a [ROWS, BLOCK_N] tile per program; a row that fits one block is loaded once (mean,
then the centred variance from registers: no cancellation). Longer rows (N > MAX_FUSED_N) are
walked in chunks twice: per-chunk mean and centred sum of squares merged with Chan's formula
(stable for any mean/std ratio), then normalize. The forward saves mean and rstd (fp32, [M]).
Backward: a persistent grid of G programs; each walks rows pid, pid+G, ... and keeps its share of
dW and dB in registers (or, for long rows, in its own row of [G, N] fp32 buffers), which the host
sums: no atomics, so the result is deterministic and the impl is registered ``deterministic=True``.
Missing weight or bias are compile-time switches: no loads, no partial buffers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...ops.layer_norm import reference  # noqa: F401  (semantics live in the op file)
from ...spec import Split
from .._double_backward import layer_norm_grads
from .._fallback import registered
from . import _native
from ._autograd import lean_apply
from ._autograd import transforms_active as _transforms_active
from ._colsum import BLOCK_C as _COLSUM_BLOCK
from ._colsum import colsum as _colsum
from ._launch import launch
from ._rows import as_rows as _as_rows
from ._rows import cdiv as _cdiv
from ._rows import contig as _contig_t
from ._rows import row_tile as _tile
from ._rows import sm_count as _sm_count
from ._rows import unrows as _unrows

# what this impl does not take goes to the torch impl, resolved by name on first use (polykernel.backends._fallback)
_torch_layer_norm = registered("norm.layer_norm")

MAX_FUSED_N = 16384  # one block per row up to here; beyond, a chunked walk
CHUNK_N = 4096

# ---------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _ln_fwd_kernel(
    X, W, B, Y, MEAN, RSTD,
    M, N, stride_x, stride_y,
    eps,
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, STORE_STATS: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    mask = row_ok[:, None] & col_ok[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / N
    xc = tl.where(mask, x - mean[:, None], 0.0)
    # sum/N is off by the sum's rounding (a constant row near 1e4 normalised to 0.3, not 0): one
    # more pass over the centred values corrects it (group_norm's _mean_centred, per row)
    mean = mean + tl.sum(xc, axis=1) / N
    xc = tl.where(mask, x - mean[:, None], 0.0)
    rstd = tl.rsqrt(tl.sum(xc * xc, axis=1) / N + eps)
    if STORE_STATS:  # inference needs no mean/rstd: no buffers to allocate
        tl.store(MEAN + rows, mean, mask=row_ok)
        tl.store(RSTD + rows, rstd, mask=row_ok)
    y = xc * rstd[:, None]
    if HAS_W:
        y = y * tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_B:
        y = y + tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _ln_fwd_chunked_kernel(
    X, W, B, Y, MEAN, RSTD,
    N, stride_x, stride_y,
    eps,
    CHUNK: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, STORE_STATS: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    y_row = Y + row * stride_y
    cols = tl.arange(0, CHUNK)
    # Running (count, mean, centred sum of squares), merged chunk by chunk (Chan et al.).
    count = 0.0
    mean = 0.0
    m2 = 0.0
    for start in range(0, N, CHUNK):
        m = start + cols < N
        x = tl.load(x_row + start + cols, mask=m, other=0.0).to(tl.float32)
        n_c = tl.cast(tl.minimum(N - start, CHUNK), tl.float32)
        mean_c = tl.sum(x, axis=0) / n_c
        d = tl.where(m, x - mean_c, 0.0)
        mean_c = mean_c + tl.sum(d, axis=0) / n_c  # the sum's rounding, corrected (see above)
        d = tl.where(m, x - mean_c, 0.0)
        total = count + n_c
        delta = mean_c - mean
        mean = mean + delta * (n_c / total)
        m2 = m2 + tl.sum(d * d, axis=0) + delta * delta * (count * n_c / total)
        count = total
    rstd = tl.rsqrt(m2 / N + eps)
    if STORE_STATS:
        tl.store(MEAN + row, mean)
        tl.store(RSTD + row, rstd)
    for start in range(0, N, CHUNK):
        m = start + cols < N
        x = tl.load(x_row + start + cols, mask=m, other=0.0).to(tl.float32)
        y = (x - mean) * rstd
        if HAS_W:
            y = y * tl.load(W + start + cols, mask=m, other=0.0).to(tl.float32)
        if HAS_B:
            y = y + tl.load(B + start + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(y_row + start + cols, y.to(Y.dtype.element_ty), mask=m)


@triton.jit
def _ln_bwd_kernel(
    X, W, DY, MEAN, RSTD, DX, DW_PART, DB_PART,
    M, N, stride_x, stride_dy, stride_dx,
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    progs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    if HAS_W:
        dw = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    if HAS_B:
        db = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    for block in range(pid, tl.cdiv(M, ROWS), progs):
        rows = tl.cast(block, tl.int64) * ROWS + tl.arange(0, ROWS)
        row_ok = rows < M
        mask = row_ok[:, None] & col_ok[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(MEAN + rows, mask=row_ok, other=0.0)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        if HAS_W:
            w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
            g = dy * w[None, :]
            dw += dy * xhat
        else:
            g = dy
        if HAS_B:
            db += dy
        c1 = tl.sum(g * xhat, axis=1) / N
        c2 = tl.sum(g, axis=1) / N
        dx = (g - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
    if HAS_W:
        tl.store(DW_PART + tl.cast(pid, tl.int64) * N + cols, tl.sum(dw, axis=0), mask=col_ok)
    if HAS_B:
        tl.store(DB_PART + tl.cast(pid, tl.int64) * N + cols, tl.sum(db, axis=0), mask=col_ok)


@triton.jit
def _ln_bwd_chunked_kernel(
    X, W, DY, MEAN, RSTD, DX, DW_PART, DB_PART,
    M, N, stride_x, stride_dy, stride_dx,
    CHUNK: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    progs = tl.num_programs(0)
    cols = tl.arange(0, CHUNK)
    dw_part = DW_PART + tl.cast(pid, tl.int64) * N  # this program's own rows: read-modify-write, no atomics
    db_part = DB_PART + tl.cast(pid, tl.int64) * N
    for row in range(pid, M, progs):
        row64 = tl.cast(row, tl.int64)
        mean = tl.load(MEAN + row64)
        rstd = tl.load(RSTD + row64)
        acc1 = tl.zeros([CHUNK], dtype=tl.float32)
        acc2 = tl.zeros([CHUNK], dtype=tl.float32)
        for start in range(0, N, CHUNK):
            m = start + cols < N
            x = tl.load(X + row64 * stride_x + start + cols, mask=m, other=0.0).to(tl.float32)
            g = tl.load(DY + row64 * stride_dy + start + cols, mask=m, other=0.0).to(tl.float32)
            if HAS_W:
                g = g * tl.load(W + start + cols, mask=m, other=0.0).to(tl.float32)
            acc1 += g * (x - mean) * rstd  # g is 0 past N
            acc2 += g
        c1 = tl.sum(acc1, axis=0) / N
        c2 = tl.sum(acc2, axis=0) / N
        for start in range(0, N, CHUNK):
            m = start + cols < N
            x = tl.load(X + row64 * stride_x + start + cols, mask=m, other=0.0).to(tl.float32)
            dy = tl.load(DY + row64 * stride_dy + start + cols, mask=m, other=0.0).to(tl.float32)
            xhat = (x - mean) * rstd
            if HAS_W:
                g = dy * tl.load(W + start + cols, mask=m, other=0.0).to(tl.float32)
                prev = tl.load(dw_part + start + cols, mask=m, other=0.0)
                tl.store(dw_part + start + cols, prev + dy * xhat, mask=m)
            else:
                g = dy
            if HAS_B:
                prev_b = tl.load(db_part + start + cols, mask=m, other=0.0)
                tl.store(db_part + start + cols, prev_b + dy, mask=m)
            dx = (g - (xhat * c1 + c2)) * rstd
            tl.store(DX + row64 * stride_dx + start + cols, dx.to(DX.dtype.element_ty), mask=m)


# ---------------------------------------------------------------------------------------------
# Host launchers

# Launch settings (a sweep may override them to measure alternatives).
TUNE = {
    "fwd_tile_elems": 4096,  # elements per program for short rows (ROWS = this // BLOCK_N)
    "fwd_warps": None,  # None: by tile size (see _tile)
    "bwd_tile_elems": 4096,
    "bwd_warps": None,
    "bwd_programs_per_sm": 2,  # persistent grid of the backward
}


def _programs(device: torch.device) -> int:
    """Persistent-grid size of the backward (4 on the CPU interpreter: several partials)."""
    return TUNE["bwd_programs_per_sm"] * _sm_count(device)


def layer_norm_forward(
    x2: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float, need_stats: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """y [M, N] in x's dtype, mean [M] and rstd [M] fp32 (None unless ``need_stats``: inference;
    weight/bias contiguous or None)."""
    m, n = x2.shape
    y = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    if need_stats:  # two allocations: one [2, M] buffer and .unbind(0) costs ~4x an empty (H200 cProfile)
        mean = torch.empty(m, dtype=torch.float32, device=x2.device)
        rstd = torch.empty(m, dtype=torch.float32, device=x2.device)
    else:
        mean = rstd = None
    if m == 0 or n == 0:
        return y, mean, rstd
    mean_p = y if mean is None else mean  # never written without STORE_STATS
    rstd_p = y if rstd is None else rstd
    # An absent parameter is never read (HAS_W/HAS_B are compile-time); any pointer will do.
    w = weight if weight is not None else x2
    b = bias if bias is not None else x2
    flags = dict(HAS_W=weight is not None, HAS_B=bias is not None)
    if n <= MAX_FUSED_N:
        block_n, rows, warps = _tile(n, TUNE["fwd_tile_elems"], TUNE["fwd_warps"])
        launch(
            _ln_fwd_kernel, (_cdiv(m, rows),),
            x2, w, b, y, mean_p, rstd_p, m, n, x2.stride(0), y.stride(0), eps,
            BLOCK_N=block_n, ROWS=rows, num_warps=warps, STORE_STATS=need_stats, **flags,
        )  # fmt: skip
    else:
        launch(
            _ln_fwd_chunked_kernel, (m,),
            x2, w, b, y, mean_p, rstd_p, n, x2.stride(0), y.stride(0), eps,
            CHUNK=CHUNK_N, num_warps=16, STORE_STATS=need_stats, **flags,
        )  # fmt: skip
    return y, mean, rstd


def layer_norm_backward(
    dy2: torch.Tensor,
    x2: torch.Tensor,
    weight: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    bias_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """dx [M, N] in x's dtype; dW [N] in weight's dtype and dB [N] in ``bias_dtype`` (None if absent)."""
    m, n = x2.shape
    dev = x2.device
    dx = torch.empty((m, n), dtype=x2.dtype, device=dev)
    has_w, has_b = weight is not None, bias_dtype is not None
    if m == 0 or n == 0:
        dw = torch.zeros(n, dtype=weight.dtype, device=dev) if has_w else None
        db = torch.zeros(n, dtype=bias_dtype, device=dev) if has_b else None
        return dx.zero_(), dw, db
    progs = min(_programs(dev), m)
    chunked = n > MAX_FUSED_N
    if not chunked:
        block_n, rows, warps = _tile(n, TUNE["bwd_tile_elems"], TUNE["bwd_warps"])
        progs = min(progs, _cdiv(m, rows))
    # The chunked kernel accumulates into its rows (read-modify-write): they start at zero.
    new = torch.zeros if chunked else torch.empty
    dw_part = new((progs, n), dtype=torch.float32, device=dev) if has_w else dx
    db_part = new((progs, n), dtype=torch.float32, device=dev) if has_b else dx
    w = weight if has_w else x2
    if not chunked:
        launch(
            _ln_bwd_kernel, (progs,),
            x2, w, dy2, mean, rstd, dx, dw_part, db_part, m, n, x2.stride(0), dy2.stride(0), dx.stride(0),
            BLOCK_N=block_n, ROWS=rows, HAS_W=has_w, HAS_B=has_b, num_warps=warps,
        )  # fmt: skip
    else:
        launch(
            _ln_bwd_chunked_kernel, (progs,),
            x2, w, dy2, mean, rstd, dx, dw_part, db_part, m, n, x2.stride(0), dy2.stride(0), dx.stride(0),
            CHUNK=CHUNK_N, HAS_W=has_w, HAS_B=has_b, num_warps=16,
        )  # fmt: skip
    # One launch each for part.sum(0).to(dtype): two host ops each.
    dw = _colsum(dw_part, weight.dtype) if has_w else None
    db = _colsum(db_part, bias_dtype) if has_b else None
    return dx, dw, db


# ---------------------------------------------------------------------------------------------
# Registered impl


def _contig(p: torch.Tensor | None) -> torch.Tensor | None:
    return None if p is None else _contig_t(p)


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):  # type: ignore[override]
        shape = x.shape
        x2 = _as_rows(x, shape[-1])
        w = _contig(weight)
        y, mean, rstd = layer_norm_forward(x2, w, _contig(bias), eps)
        # the inputs themselves as well where x2 / w are other tensors (made here, without a graph),
        # and bias: a create_graph backward differentiates through them
        if x2 is x and w is weight and bias is None:
            ctx.save_for_backward(x2, w, mean, rstd)
        else:
            ctx.save_for_backward(x2, w, mean, rstd, x, weight, bias)
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.shape, ctx.eps = shape, eps
        return _unrows(y, shape)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x2, w, mean, rstd, *inputs = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: differentiable gradients, by the torch formula
            x, weight, bias = inputs or (x2, w, None)
            return (*layer_norm_grads(x, weight, bias, ctx.eps, dy, ctx.needs_input_grad), None)
        dx, dw, db = layer_norm_backward(_as_rows(dy, x2.shape[1]), x2, w, mean, rstd, ctx.bias_dtype)
        need = ctx.needs_input_grad
        return (_unrows(dx, ctx.shape) if need[0] else None, dw if need[1] else None, db if need[2] else None, None)


_lean_apply = lean_apply(_LayerNorm)  # _LayerNorm.apply without its Python wrapper (see _autograd.py)


class _NativePlan:
    """The C++ path's plan for one (dtypes, N, parameters present, device): slots and tile numbers."""

    def __init__(self, x: torch.Tensor, has_w: bool, has_b: bool) -> None:
        n = x.shape[-1]
        flags = dict(HAS_W=has_w, HAS_B=has_b)
        block_n, self.rows_fwd, warps = _tile(n, TUNE["fwd_tile_elems"], TUNE["fwd_warps"])
        fwd = dict(BLOCK_N=block_n, ROWS=self.rows_fwd, num_warps=warps, **flags)
        self.fwd = _native.slot(_ln_fwd_kernel, STORE_STATS=True, **fwd)
        self.fwd_infer = _native.slot(_ln_fwd_kernel, STORE_STATS=False, **fwd)
        block_n, self.rows_bwd, warps = _tile(n, TUNE["bwd_tile_elems"], TUNE["bwd_warps"])
        self.bwd = _native.slot(_ln_bwd_kernel, BLOCK_N=block_n, ROWS=self.rows_bwd, num_warps=warps, **flags)
        self.programs = _programs(x.device)
        self.colsum_w = self.colsum_b = _native.colsum_slot()
        self.colsum_block = _COLSUM_BLOCK


def _native_plan(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> _NativePlan | None:
    """Rows that fit one tile: the shapes the C++ path mirrors."""
    return _NativePlan(x, weight is not None, bias is not None) if x.shape[-1] <= MAX_FUSED_N else None


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The registered impl (arguments already validated by ``polykernel.layer_norm``)."""
    if _native.ENABLED:
        y = _native.call("layer_norm", (x, weight, bias, eps), (x, weight, bias), _native_plan)
        if y is not None:
            return y
    if _transforms_active():  # functorch (vmap, grad): the kernels cannot read its wrapped tensors
        return _torch_layer_norm(x, weight, bias, eps)
    if (x.requires_grad or (weight is not None and weight.requires_grad) or (bias is not None and bias.requires_grad)) and (
        torch.is_grad_enabled()
    ):
        return _lean_apply(x, weight, bias, eps)
    shape = x.shape
    y, _, _ = layer_norm_forward(_as_rows(x, shape[-1]), _contig(weight), _contig(bias), eps, need_stats=False)
    return _unrows(y, shape)


# Forward and backward as separate functions, for compiled graphs (polykernel.compile.library): the
# backward runs on the saved statistics, no recompute. Saved layout: the torch impl's (mean and
# rstd, fp32 [M]).
def _split_forward(x, weight, bias, eps, grad_mask):
    y, mean, rstd = layer_norm_forward(_as_rows(x, x.shape[-1]), _contig(weight), _contig(bias), eps)
    return (y.view(x.shape),), (mean, rstd)


def _split_backward(grads, saved, x, weight, bias, eps, grad_mask):
    n = x.shape[-1]
    dx, dw, db = layer_norm_backward(
        _as_rows(grads[0], n), _as_rows(x, n), _contig(weight), saved[0], saved[1], None if bias is None else bias.dtype
    )
    return [dx.view(x.shape), dw, db, None]


layer_norm.split = Split(forward=_split_forward, backward=_split_backward)  # type: ignore[attr-defined]
