"""Triton GroupNorm: forward and backward (dX, dW, dB), any group size, any ``[N, C, *]`` shape.

x is viewed as ``[N·G, L]`` rows, one per (sample, group), with ``L = (C/G)·S`` (S positions per
channel): a group's channels are consecutive, so each row is itself a ``[C/G, S]`` tile whose
rows are channels. A program loads its group as such a tile (``[BLOCK_C, BLOCK_S]``, the weight
and bias as one value per tile row): a group that fits one tile (``BLOCK_C·BLOCK_S <=
MAX_TILE``) is loaded once (mean, corrected once, then the centred variance from registers: no
cancellation);
larger groups are walked in tiles twice, per-tile means and centred sums of squares merged with
Chan's formula (stable for any mean/std ratio). The forward saves mean and rstd (fp32, [N·G]).

Backward: a grid of (P, G) programs; program (p, g) walks samples p, p+P, ... of group g and
keeps its share of each channel's dW and dB (a sum over that sample's positions, added sample
after sample) in registers, or for large groups in its own row of the [P, C] fp32 partial
buffers, which the host sums in a fixed order: no atomics, so the result is deterministic and
the impl is registered ``deterministic=True``. Missing weight or bias are compile-time switches.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ...ops.group_norm import reference
from .._double_backward import graph_grads
from .._fallback import registered
from ._autograd import lean_apply
from ._autograd import transforms_active as _transforms_active
from ._colsum import colsum as _colsum
from ._launch import launch
from ._rows import contig as _contig_t
from ._rows import next_pow2 as _next_pow2
from ._rows import sm_count as _sm_count

# what this impl does not take goes to the torch impl, resolved by name on first use (polykernel.backends._fallback)
_torch_group_norm = registered("norm.group_norm")

MAX_TILE = 16384  # a group of up to this many (padded) elements is loaded once
CHUNK = 4096  # elements per tile when walking larger groups

# ---------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _mean_centred(x, mask, n):
    """(mean, centred tile) of the ``mask``-ed elements of tile ``x`` (``n`` of them). sum/n is
    off the exact mean by the sum's rounding (~1 ulp of the mean for a constant group of 3000
    values near 1e4, which eps=1e-5 then scales to 0.3 instead of 0): one more pass over the
    centred values corrects it, so a constant tile has its value as mean and centres to 0."""
    mean = tl.sum(tl.sum(x, axis=1), axis=0) / n
    xc = tl.where(mask, x - mean, 0.0)
    mean = mean + tl.sum(tl.sum(xc, axis=1), axis=0) / n
    return mean, tl.where(mask, x - mean, 0.0)


@triton.jit
def _gn_fwd_kernel(
    X, W, B, Y, MEAN, RSTD,
    G, CG, S, stride_x, stride_y,
    eps,
    BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, STORE_STATS: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)  # (sample, group) = divmod(row, G)
    g = row % G
    c = tl.arange(0, BLOCK_C)
    s = tl.arange(0, BLOCK_S)
    c_ok = c < CG
    mask = c_ok[:, None] & (s < S)[None, :]
    offs = c[:, None] * S + s[None, :]
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    n = (CG * S) * 1.0  # (CG or S may be the constant 1: an int then)
    mean, xc = _mean_centred(x, mask, n)
    rstd = tl.rsqrt(tl.sum(tl.sum(xc * xc, axis=1), axis=0) / n + eps)
    y = xc * rstd
    ch = g * CG + c
    if HAS_W:
        y = y * tl.load(W + ch, mask=c_ok, other=0.0).to(tl.float32)[:, None]
    if HAS_B:
        y = y + tl.load(B + ch, mask=c_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(Y + row * stride_y + offs, y.to(Y.dtype.element_ty), mask=mask)
    if STORE_STATS:  # inference needs no mean/rstd: no buffers to allocate
        tl.store(MEAN + row, mean)
        tl.store(RSTD + row, rstd)


@triton.jit
def _gn_fwd_chunked_kernel(
    X, W, B, Y, MEAN, RSTD,
    G, CG, S, stride_x, stride_y,
    eps,
    BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, STORE_STATS: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    g = row % G
    x_row = X + row * stride_x
    y_row = Y + row * stride_y
    c = tl.arange(0, BLOCK_C)
    s = tl.arange(0, BLOCK_S)
    # Running (count, mean, centred sum of squares), merged tile by tile (Chan et al.).
    count = 0.0
    mean = 0.0
    m2 = 0.0
    for c0 in range(0, CG, BLOCK_C):
        c_ok = c0 + c < CG
        for s0 in range(0, S, BLOCK_S):
            mask = c_ok[:, None] & (s0 + s < S)[None, :]
            offs = (c0 + c).to(tl.int64)[:, None] * S + (s0 + s)[None, :]
            x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
            n_t = (tl.minimum(CG - c0, BLOCK_C) * tl.minimum(S - s0, BLOCK_S)).to(tl.float32)
            mean_t, d = _mean_centred(x, mask, n_t)
            total = count + n_t
            delta = mean_t - mean
            mean = mean + delta * (n_t / total)
            m2 = m2 + tl.sum(tl.sum(d * d, axis=1), axis=0) + delta * delta * (count * n_t / total)
            count = total
    rstd = tl.rsqrt(m2 / count + eps)
    if STORE_STATS:
        tl.store(MEAN + row, mean)
        tl.store(RSTD + row, rstd)
    for c0 in range(0, CG, BLOCK_C):
        c_ok = c0 + c < CG
        ch = g * CG + c0 + c
        if HAS_W:
            w = tl.load(W + ch, mask=c_ok, other=0.0).to(tl.float32)
        if HAS_B:
            b = tl.load(B + ch, mask=c_ok, other=0.0).to(tl.float32)
        for s0 in range(0, S, BLOCK_S):
            mask = c_ok[:, None] & (s0 + s < S)[None, :]
            offs = (c0 + c).to(tl.int64)[:, None] * S + (s0 + s)[None, :]
            y = (tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32) - mean) * rstd
            if HAS_W:
                y = y * w[:, None]
            if HAS_B:
                y = y + b[:, None]
            tl.store(y_row + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _gn_bwd_kernel(
    X, W, DY, MEAN, RSTD, DX, DW_PART, DB_PART,
    N, G, CG, S, stride_x, stride_dy, stride_dx,
    BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
):  # fmt: skip
    p = tl.program_id(0)
    progs = tl.num_programs(0)
    g = tl.program_id(1)
    c = tl.arange(0, BLOCK_C)
    s = tl.arange(0, BLOCK_S)
    c_ok = c < CG
    mask = c_ok[:, None] & (s < S)[None, :]
    offs = c[:, None] * S + s[None, :]
    ch = g * CG + c
    n = (CG * S) * 1.0  # (CG or S may be the constant 1: an int then)
    if HAS_W:
        w = tl.load(W + ch, mask=c_ok, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK_C], dtype=tl.float32)
    if HAS_B:
        db = tl.zeros([BLOCK_C], dtype=tl.float32)
    for sample in range(p, N, progs):
        row = tl.cast(sample, tl.int64) * G + g
        x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + offs, mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(MEAN + row)
        rstd = tl.load(RSTD + row)
        xhat = tl.where(mask, (x - mean) * rstd, 0.0)
        if HAS_W:
            gw = dy * w[:, None]
            dw += tl.sum(dy * xhat, axis=1)
        else:
            gw = dy
        if HAS_B:
            db += tl.sum(dy, axis=1)
        c1 = tl.sum(tl.sum(gw * xhat, axis=1), axis=0) / n
        c2 = tl.sum(tl.sum(gw, axis=1), axis=0) / n
        dx = (gw - (xhat * c1 + c2)) * rstd
        tl.store(DX + row * stride_dx + offs, dx.to(DX.dtype.element_ty), mask=mask)
    C = G * CG
    if HAS_W:
        tl.store(DW_PART + tl.cast(p, tl.int64) * C + ch, dw, mask=c_ok)
    if HAS_B:
        tl.store(DB_PART + tl.cast(p, tl.int64) * C + ch, db, mask=c_ok)


@triton.jit
def _gn_bwd_chunked_kernel(
    X, W, DY, MEAN, RSTD, DX, DW_PART, DB_PART,
    N, G, CG, S, stride_x, stride_dy, stride_dx,
    BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
):  # fmt: skip
    p = tl.program_id(0)
    progs = tl.num_programs(0)
    g = tl.program_id(1)
    c = tl.arange(0, BLOCK_C)
    s = tl.arange(0, BLOCK_S)
    n = (CG * S) * 1.0  # (CG or S may be the constant 1: an int then)
    C = G * CG
    dw_part = DW_PART + tl.cast(p, tl.int64) * C  # this program's own row: read-modify-write, no atomics
    db_part = DB_PART + tl.cast(p, tl.int64) * C
    for sample in range(p, N, progs):
        row = tl.cast(sample, tl.int64) * G + g
        x_row = X + row * stride_x
        dy_row = DY + row * stride_dy
        mean = tl.load(MEAN + row)
        rstd = tl.load(RSTD + row)
        acc1 = tl.zeros([BLOCK_C, BLOCK_S], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK_C, BLOCK_S], dtype=tl.float32)
        for c0 in range(0, CG, BLOCK_C):
            c_ok = c0 + c < CG
            ch = g * CG + c0 + c
            if HAS_W:
                w = tl.load(W + ch, mask=c_ok, other=0.0).to(tl.float32)
            dw_c = tl.zeros([BLOCK_C], dtype=tl.float32)
            db_c = tl.zeros([BLOCK_C], dtype=tl.float32)
            for s0 in range(0, S, BLOCK_S):
                mask = c_ok[:, None] & (s0 + s < S)[None, :]
                offs = (c0 + c).to(tl.int64)[:, None] * S + (s0 + s)[None, :]
                x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(dy_row + offs, mask=mask, other=0.0).to(tl.float32)
                xhat = tl.where(mask, (x - mean) * rstd, 0.0)
                if HAS_W:
                    gw = dy * w[:, None]
                else:
                    gw = dy
                acc1 += gw * xhat
                acc2 += gw
                dw_c += tl.sum(dy * xhat, axis=1)
                db_c += tl.sum(dy, axis=1)
            if HAS_W:
                prev = tl.load(dw_part + ch, mask=c_ok, other=0.0)
                tl.store(dw_part + ch, prev + dw_c, mask=c_ok)
            if HAS_B:
                prev_b = tl.load(db_part + ch, mask=c_ok, other=0.0)
                tl.store(db_part + ch, prev_b + db_c, mask=c_ok)
        c1 = tl.sum(tl.sum(acc1, axis=1), axis=0) / n
        c2 = tl.sum(tl.sum(acc2, axis=1), axis=0) / n
        for c0 in range(0, CG, BLOCK_C):
            c_ok = c0 + c < CG
            if HAS_W:
                w = tl.load(W + g * CG + c0 + c, mask=c_ok, other=0.0).to(tl.float32)
            for s0 in range(0, S, BLOCK_S):
                mask = c_ok[:, None] & (s0 + s < S)[None, :]
                offs = (c0 + c).to(tl.int64)[:, None] * S + (s0 + s)[None, :]
                x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(dy_row + offs, mask=mask, other=0.0).to(tl.float32)
                xhat = (x - mean) * rstd
                if HAS_W:
                    gw = dy * w[:, None]
                else:
                    gw = dy
                dx = (gw - (xhat * c1 + c2)) * rstd
                tl.store(DX + row * stride_dx + offs, dx.to(DX.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------
# Host launchers

# Launch settings (a sweep may override them to measure alternatives).
TUNE = {
    "warps": None,  # None: by tile size (see _tile)
    "bwd_programs_per_sm": 2,  # programs of the backward over (samples, groups), per SM
}


def _tile(cg: int, s: int) -> tuple[int, int, bool, int]:
    """(BLOCK_C, BLOCK_S, one tile holds the group, num_warps) for groups of ``cg`` channels of
    ``s`` positions: the whole group padded to powers of two if that fits MAX_TILE, else tiles
    of about CHUNK elements, positions first (they are contiguous)."""
    bc, bs = _next_pow2(max(cg, 1)), _next_pow2(max(s, 1))
    if bc * bs <= MAX_TILE:
        elems, fused = bc * bs, True
    else:
        bs = min(bs, CHUNK)
        bc = max(1, min(bc, CHUNK // bs))
        elems, fused = bc * bs, False
    warps = TUNE["warps"] or (4 if elems <= 2048 else 8 if elems <= 4096 else 16)
    return bc, bs, fused, warps


def _samples_programs(device: torch.device, n: int, groups: int) -> int:
    """P, the backward's programs per group: about ``bwd_programs_per_sm`` per SM in all."""
    return max(1, min(n, TUNE["bwd_programs_per_sm"] * _sm_count(device) // groups))


def group_norm_forward(
    x2: torch.Tensor,
    groups: int,
    cg: int,
    s: int,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    need_stats: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """y [N·G, L] in x's dtype, mean [N·G] and rstd [N·G] fp32 (None unless ``need_stats``);
    x2 is [N·G, L] with unit column stride, weight/bias contiguous or None."""
    rows, length = x2.shape
    y = torch.empty((rows, length), dtype=x2.dtype, device=x2.device)
    mean = torch.empty(rows, dtype=torch.float32, device=x2.device) if need_stats else None
    rstd = torch.empty(rows, dtype=torch.float32, device=x2.device) if need_stats else None
    if rows == 0 or length == 0:
        return y, mean, rstd
    stats = (y, y) if mean is None else (mean, rstd)  # never written without STORE_STATS
    # An absent parameter is never read (HAS_W/HAS_B are compile-time); any pointer will do.
    w = weight if weight is not None else x2
    b = bias if bias is not None else x2
    bc, bs, fused, warps = _tile(cg, s)
    launch(
        _gn_fwd_kernel if fused else _gn_fwd_chunked_kernel, (rows,),
        x2, w, b, y, *stats, groups, cg, s, x2.stride(0), y.stride(0), eps,
        BLOCK_C=bc, BLOCK_S=bs, HAS_W=weight is not None, HAS_B=bias is not None, STORE_STATS=need_stats, num_warps=warps,
    )  # fmt: skip
    return y, mean, rstd


def group_norm_backward(
    dy2: torch.Tensor,
    x2: torch.Tensor,
    groups: int,
    cg: int,
    s: int,
    weight: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    bias_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """dx [N·G, L] in x's dtype; dW [C] in weight's dtype and dB [C] in ``bias_dtype`` (None if absent)."""
    rows, length = x2.shape
    dev = x2.device
    c = groups * cg
    dx = torch.empty((rows, length), dtype=x2.dtype, device=dev)
    has_w, has_b = weight is not None, bias_dtype is not None
    if rows == 0 or length == 0:
        dw = torch.zeros(c, dtype=weight.dtype, device=dev) if has_w else None
        db = torch.zeros(c, dtype=bias_dtype, device=dev) if has_b else None
        return dx, dw, db
    n = rows // groups
    progs = _samples_programs(dev, n, groups)
    bc, bs, fused, warps = _tile(cg, s)
    # The chunked kernel accumulates into its rows (read-modify-write): they start at zero.
    new = torch.empty if fused else torch.zeros
    dw_part = new((progs, c), dtype=torch.float32, device=dev) if has_w else dx
    db_part = new((progs, c), dtype=torch.float32, device=dev) if has_b else dx
    w = weight if has_w else x2
    launch(
        _gn_bwd_kernel if fused else _gn_bwd_chunked_kernel, (progs, groups),
        x2, w, dy2, mean, rstd, dx, dw_part, db_part, n, groups, cg, s, x2.stride(0), dy2.stride(0), dx.stride(0),
        BLOCK_C=bc, BLOCK_S=bs, HAS_W=has_w, HAS_B=has_b, num_warps=warps,
    )  # fmt: skip
    dw = _colsum(dw_part, weight.dtype) if has_w else None
    db = _colsum(db_part, bias_dtype) if has_b else None
    return dx, dw, db


# ---------------------------------------------------------------------------------------------
# Registered impl


def _dims(x: torch.Tensor, groups: int) -> tuple[int, int, int]:
    """(channels per group, positions per channel, group length L) of x [N, C, *]."""
    cg, s = x.shape[1] // groups, math.prod(x.shape[2:])
    return cg, s, cg * s


def _group_rows(t: torch.Tensor, groups: int, length: int) -> torch.Tensor:
    """t [N, C, *] as [N·G, L] rows with unit column stride (copies only when the layout needs it)."""
    t2 = t.reshape(t.shape[0] * groups, length)
    return t2 if t2.stride(-1) == 1 or t2.numel() == 0 else t2.contiguous()


def _contig(p: torch.Tensor | None) -> torch.Tensor | None:
    return None if p is None else _contig_t(p)


class _GroupNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, groups, weight, bias, eps):  # type: ignore[override]
        cg, s, length = _dims(x, groups)
        x2 = _group_rows(x, groups, length)
        w = _contig(weight)
        y, mean, rstd = group_norm_forward(x2, groups, cg, s, w, _contig(bias), eps)
        # the inputs themselves too (x2, w are other tensors, made here without a graph): a
        # create_graph backward differentiates through them
        ctx.save_for_backward(x2, w, mean, rstd, x, weight, bias)
        ctx.layout = (x.shape, groups, cg, s)
        ctx.eps = eps
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x2, w, mean, rstd, x, weight, bias = ctx.saved_tensors
        shape, groups, cg, s = ctx.layout
        if torch.is_grad_enabled():  # create_graph=True: the reference's differentiable gradients
            need = ctx.needs_input_grad
            return (*graph_grads(reference, (x, groups, weight, bias, ctx.eps), (dy,), (need[0], False, need[2], need[3], False)),)
        dy2 = _group_rows(dy, groups, cg * s)
        dx, dw, db = group_norm_backward(dy2, x2, groups, cg, s, w, mean, rstd, ctx.bias_dtype)
        need = ctx.needs_input_grad
        return (dx.view(shape) if need[0] else None, None, dw if need[2] else None, db if need[3] else None, None)


_lean_apply = lean_apply(_GroupNorm)  # _GroupNorm.apply without its Python wrapper (see _autograd.py)


def group_norm(x: torch.Tensor, num_groups: int, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The registered impl (arguments already validated by ``polykernel.group_norm``)."""
    if _transforms_active():  # functorch (vmap, grad): the kernels cannot read its wrapped tensors
        return _torch_group_norm(x, num_groups, weight, bias, eps)
    if (x.requires_grad or (weight is not None and weight.requires_grad) or (bias is not None and bias.requires_grad)) and (
        torch.is_grad_enabled()
    ):
        return _lean_apply(x, num_groups, weight, bias, eps)
    cg, s, length = _dims(x, num_groups)
    y, _, _ = group_norm_forward(_group_rows(x, num_groups, length), num_groups, cg, s, _contig(weight), _contig(bias), eps)
    return y.view(x.shape)
