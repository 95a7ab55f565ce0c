"""Triton RoPE (rotate-half): forward and backward (dq, dk) with one kernel per layout of work.

Two ways to cut the work, same math:
- *heads* (short sequences, decode): one program takes BLOCK_T consecutive positions of one batch
  row and every head of q and of k; cos/sin for those positions are loaded once (per BLOCK_D chunk
  of the half dim) and reused across all heads.
- *rows* (long sequences): one program takes BLOCK_T consecutive positions of one head (of q or
  of k), a streaming tile like an elementwise kernel's; cos/sin rows are re-read per head from L2.

Each head row is read as its two halves x1 = x[:D/2], x2 = x[D/2:]:

    forward:  o1 = x1·c1 - x2·s1      o2 = x2·c2 + x1·s2
    backward: o1 = g1·c1 + g2·s2      o2 = g2·c2 - g1·s1   (the transposed rotation, by -sin)

Options (constexprs, so the default kernel is the same code as without them): ``INTERLEAVED``
pairs x1 = x[2i], x2 = x[2i+1] (GPT-J) instead of the halves, and the tables are read at the same
feature indices; ``PASS`` = D - R features after the R rotary ones (partial rotary, R = the
tables' width, HALF = R/2) are copied through unchanged (the backward copies the gradient).

Every tensor is addressed through its own strides (q/k/outputs as [B, H, T, D], cos/sin as
[B, T, D] with batch stride 0 when broadcast), so HF's transposed views [B, T, H, D].transpose(1, 2)
and slices of a fused QKV projection run without a copy; outputs keep q's/k's dense layout
(``empty_like``). Math is fp32; no atomics, so the backward is deterministic. This impl computes
no cos/sin gradient: the op's predicate keeps it from being selected when cos/sin need one.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from ...ops.rope import reference  # noqa: F401  (semantics live in the op file)
from .._fallback import registered
from .._functions import rope_function
from . import _native
from ._autograd import lean_apply
from ._autograd import transforms_active as _transforms_active
from ._launch import launch
from ._rows import cdiv as _cdiv
from ._rows import next_pow2 as _next_pow2

# what this impl does not take goes to the torch impl, resolved by name on first use (polykernel.backends._fallback)
_torch_rope = registered("embedding.rope")

# The heads kernel: elements per half-tile [BLOCK_T, BLOCK_H, BLOCK_D] (two halves per head row),
# and the warps that share one. 1024 elements on 1 warp beat 2048 on up to 4 warps at q
# 4x32x4096x128 (benchmarks/results/h200-2026-11-30-kernel-variants/)
ELEMS = 1024
MAX_BLOCK_D = 128  # half dims up to 128 (D <= 256) in one chunk; longer ones are walked in chunks
MAX_WARPS = 1  # benchmarks/kernels/kernel_variants.py A/Bs these (call _tiles.cache_clear() after a change)
# The rows kernel from this many positions on (a power of two: the native path keys plans on T's
# next power of two), with ROW_ELEMS elements (both halves) per program on ROW_WARPS warps. The
# heads kernel's 1-warp programs cap occupancy at 50% (32 blocks per SM). At q 4x32x4096x128 rows
# of 2048 on 4 warps beat the heads kernel, and 1024/4 or 2048/8 (rows 1024/2 ties):
# benchmarks/results/h200-2026-11-30-kernel-variants-late/.
ROWS_MIN_T = 64
ROW_ELEMS = 2048
ROW_WARPS = 4


# ---------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _pair(d, HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Feature indices of pair d's two members: (d, d + HALF) rotate-half, (2d, 2d + 1) GPT-J."""
    if INTERLEAVED:
        return 2 * d, 2 * d + 1
    else:
        return d, d + HALF


@triton.jit
def _cos_sin(c_row, s_row, d, m, sc_d, ss_d, HALF: tl.constexpr, BACKWARD: tl.constexpr, INTERLEAVED: tl.constexpr):
    """cos and sin of both pair members for rows c_row/s_row ([BLOCK_T, 1]) at pairs d ([1, BLOCK_D])
    in fp32, as (c1, c2, sa, sb) with o1 = x1·c1 - x2·sa, o2 = x2·c2 + x1·sb: the backward's
    transposed rotation swaps and negates the sines."""
    i1, i2 = _pair(d, HALF, INTERLEAVED)
    c1 = tl.load(c_row + i1 * sc_d, mask=m, other=0.0).to(tl.float32)
    c2 = tl.load(c_row + i2 * sc_d, mask=m, other=0.0).to(tl.float32)
    s1 = tl.load(s_row + i1 * ss_d, mask=m, other=0.0).to(tl.float32)
    s2 = tl.load(s_row + i2 * ss_d, mask=m, other=0.0).to(tl.float32)
    if BACKWARD:
        sa = -s2
        sb = -s1
    else:
        sa = s1
        sb = s2
    return c1, c2, sa, sb


@triton.jit
def _rot_heads(
    X,
    OUT,
    x_base,
    o_base,
    H,
    sx_h,
    sx_d,
    so_h,
    so_d,
    t_ok,
    d,
    d_ok,
    c1,
    c2,
    sa,
    sb,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    INTERLEAVED: tl.constexpr,
):
    """Rotate heads [0, H) of the rows at x_base ([BLOCK_T, 1, 1] offsets) for the d chunk."""
    i1, i2 = _pair(d[None, None, :], HALF, INTERLEAVED)
    td_ok = t_ok[:, None, None] & d_ok[None, None, :]
    for h0 in range(0, H, BLOCK_H):
        h = tl.cast(h0, tl.int64) + tl.arange(0, BLOCK_H).to(tl.int64)
        h3 = h[None, :, None]
        mask = td_ok & (h < H)[None, :, None]
        px = X + x_base + h3 * sx_h
        x1 = tl.load(px + i1 * sx_d, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(px + i2 * sx_d, mask=mask, other=0.0).to(tl.float32)
        o1 = x1 * c1 - x2 * sa
        o2 = x2 * c2 + x1 * sb
        po = OUT + o_base + h3 * so_h
        tl.store(po + i1 * so_d, o1.to(OUT.dtype.element_ty), mask=mask)
        tl.store(po + i2 * so_d, o2.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _pass_heads(
    X, OUT, x_base, o_base, H, sx_h, sx_d, so_h, so_d, t_ok,
    ROT: tl.constexpr, PASS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """Copy features [ROT, ROT + PASS) of heads [0, H) unchanged (partial rotary's tail)."""
    for p0 in tl.static_range(0, PASS, BLOCK_D):
        e = (ROT + p0 + tl.arange(0, BLOCK_D)).to(tl.int64)
        e3 = e[None, None, :]
        te_ok = t_ok[:, None, None] & (e < ROT + PASS)[None, None, :]
        for h0 in range(0, H, BLOCK_H):
            h = tl.cast(h0, tl.int64) + tl.arange(0, BLOCK_H).to(tl.int64)
            h3 = h[None, :, None]
            mask = te_ok & (h < H)[None, :, None]
            x = tl.load(X + x_base + h3 * sx_h + e3 * sx_d, mask=mask, other=0.0)
            tl.store(OUT + o_base + h3 * so_h + e3 * so_d, x.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    Q,
    K,
    QO,
    KO,
    COS,
    SIN,
    T,
    n_tblocks,
    HQ,
    HK,
    sq_b,
    sq_h,
    sq_t,
    sq_d,
    sk_b,
    sk_h,
    sk_t,
    sk_d,
    sqo_b,
    sqo_h,
    sqo_t,
    sqo_d,
    sko_b,
    sko_h,
    sko_t,
    sko_d,
    sc_b,
    sc_t,
    sc_d,
    ss_b,
    ss_t,
    ss_d,
    HALF: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BACKWARD: tl.constexpr,
    INTERLEAVED: tl.constexpr = False,
    PASS: tl.constexpr = 0,
):
    pid = tl.program_id(0)
    b = tl.cast(pid // n_tblocks, tl.int64)
    t = tl.cast(pid % n_tblocks, tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    t_ok = t < T
    t3 = t[:, None, None]
    q_base = b * sq_b + t3 * sq_t
    k_base = b * sk_b + t3 * sk_t
    qo_base = b * sqo_b + t3 * sqo_t
    ko_base = b * sko_b + t3 * sko_t
    c_row = COS + b * sc_b + t[:, None] * sc_t
    s_row = SIN + b * ss_b + t[:, None] * ss_t
    for d0 in tl.static_range(0, HALF, BLOCK_D):
        d = (d0 + tl.arange(0, BLOCK_D)).to(tl.int64)
        d_ok = d < HALF
        c1, c2, sa, sb = _cos_sin(c_row, s_row, d[None, :], t_ok[:, None] & d_ok[None, :], sc_d, ss_d, HALF, BACKWARD, INTERLEAVED)
        c1, c2, sa, sb = c1[:, None, :], c2[:, None, :], sa[:, None, :], sb[:, None, :]  # broadcast over heads
        _rot_heads(Q, QO, q_base, qo_base, HQ, sq_h, sq_d, sqo_h, sqo_d, t_ok, d, d_ok, c1, c2, sa, sb, HALF, BLOCK_HQ, INTERLEAVED)
        _rot_heads(K, KO, k_base, ko_base, HK, sk_h, sk_d, sko_h, sko_d, t_ok, d, d_ok, c1, c2, sa, sb, HALF, BLOCK_HK, INTERLEAVED)
    if PASS > 0:
        _pass_heads(Q, QO, q_base, qo_base, HQ, sq_h, sq_d, sqo_h, sqo_d, t_ok, 2 * HALF, PASS, BLOCK_D, BLOCK_HQ)
        _pass_heads(K, KO, k_base, ko_base, HK, sk_h, sk_d, sko_h, sko_d, t_ok, 2 * HALF, PASS, BLOCK_D, BLOCK_HK)


@triton.jit
def _rot_rows(
    X, OUT, COS, SIN, b, h, t, T,
    sx_b, sx_h, sx_t, sx_d, so_b, so_h, so_t, so_d, sc_b, sc_t, sc_d, ss_b, ss_t, ss_d,
    HALF: tl.constexpr, BLOCK_D: tl.constexpr, BACKWARD: tl.constexpr, INTERLEAVED: tl.constexpr, PASS: tl.constexpr,
):  # fmt: skip
    """Rotate positions t ([BLOCK_T], int64) of head h of batch row b (and copy its PASS tail)."""
    t_ok = t < T
    x_row = X + b * sx_b + h * sx_h + t[:, None] * sx_t
    o_row = OUT + b * so_b + h * so_h + t[:, None] * so_t
    c_row = COS + b * sc_b + t[:, None] * sc_t
    s_row = SIN + b * ss_b + t[:, None] * ss_t
    for d0 in tl.static_range(0, HALF, BLOCK_D):
        d = (d0 + tl.arange(0, BLOCK_D)).to(tl.int64)[None, :]
        m = t_ok[:, None] & (d < HALF)
        c1, c2, sa, sb = _cos_sin(c_row, s_row, d, m, sc_d, ss_d, HALF, BACKWARD, INTERLEAVED)
        i1, i2 = _pair(d, HALF, INTERLEAVED)
        x1 = tl.load(x_row + i1 * sx_d, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(x_row + i2 * sx_d, mask=m, other=0.0).to(tl.float32)
        o1 = x1 * c1 - x2 * sa
        o2 = x2 * c2 + x1 * sb
        tl.store(o_row + i1 * so_d, o1.to(OUT.dtype.element_ty), mask=m)
        tl.store(o_row + i2 * so_d, o2.to(OUT.dtype.element_ty), mask=m)
    for p0 in tl.static_range(0, PASS, BLOCK_D):
        e = (2 * HALF + p0 + tl.arange(0, BLOCK_D)).to(tl.int64)[None, :]
        m = t_ok[:, None] & (e < 2 * HALF + PASS)
        x = tl.load(x_row + e * sx_d, mask=m, other=0.0)
        tl.store(o_row + e * so_d, x.to(OUT.dtype.element_ty), mask=m)


@triton.jit
def _rope_rows_kernel(
    Q, K, QO, KO, COS, SIN, T, n_tblocks, HQ, HK,
    sq_b, sq_h, sq_t, sq_d, sk_b, sk_h, sk_t, sk_d,
    sqo_b, sqo_h, sqo_t, sqo_d, sko_b, sko_h, sko_t, sko_d,
    sc_b, sc_t, sc_d, ss_b, ss_t, ss_d,
    HALF: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BACKWARD: tl.constexpr,
    INTERLEAVED: tl.constexpr = False, PASS: tl.constexpr = 0,
):  # fmt: skip
    """The rows layout: program (b, head of q then of k, block of positions); the heads kernel's
    arguments (BLOCK_HQ/BLOCK_HK unused), so one host path launches either."""
    pid = tl.program_id(0)
    bh = pid // n_tblocks
    t = tl.cast(pid % n_tblocks, tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    h = bh % (HQ + HK)
    b = tl.cast(bh // (HQ + HK), tl.int64)
    if h < HQ:
        _rot_rows(
            Q, QO, COS, SIN, b, tl.cast(h, tl.int64), t, T,
            sq_b, sq_h, sq_t, sq_d, sqo_b, sqo_h, sqo_t, sqo_d, sc_b, sc_t, sc_d, ss_b, ss_t, ss_d,
            HALF, BLOCK_D, BACKWARD, INTERLEAVED, PASS,
        )  # fmt: skip
    else:
        _rot_rows(
            K, KO, COS, SIN, b, tl.cast(h - HQ, tl.int64), t, T,
            sk_b, sk_h, sk_t, sk_d, sko_b, sko_h, sko_t, sko_d, sc_b, sc_t, sc_d, ss_b, ss_t, ss_d,
            HALF, BLOCK_D, BACKWARD, INTERLEAVED, PASS,
        )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Host launcher


def _pow2(n: int) -> int:
    return _next_pow2(max(n, 1))


class Tiles(NamedTuple):
    """One launch shape: the kernel (rows: one program per head and block of positions; heads: per
    block of positions, every head) and its tile."""

    rows: bool
    block_t: int
    block_d: int
    block_hq: int
    block_hk: int
    warps: int

    @property
    def kernel(self) -> Any:
        return _rope_rows_kernel if self.rows else _rope_kernel

    def programs(self, b: int, t: int, hq: int, hk: int) -> int:
        return b * _cdiv(t, self.block_t) * (hq + hk if self.rows else 1)


@functools.lru_cache(maxsize=4096)  # host time: the same few shapes on every call
def _tiles(t: int, hq: int, hk: int, half: int) -> Tiles:
    """The rows kernel from ROWS_MIN_T positions on (ROW_ELEMS per program); below, the heads
    kernel: ~ELEMS elements per half-tile, all heads of one position in one tile where they fit,
    and several positions per program when a position is small. Depends on t only through its
    next power of two (the native path's plan key)."""
    block_d = min(_pow2(half), MAX_BLOCK_D)
    if _pow2(t) >= ROWS_MIN_T:
        return Tiles(True, min(_pow2(t), max(1, ROW_ELEMS // (2 * block_d))), block_d, 1, 1, ROW_WARPS)
    cap_h = max(1, ELEMS // block_d)
    block_hq = min(_pow2(hq), cap_h)
    block_hk = min(_pow2(hk), cap_h)
    block_t = min(_pow2(t), max(1, ELEMS // (max(block_hq, block_hk) * block_d)))
    elems = block_t * max(block_hq, block_hk) * block_d
    warps = max(1, min(MAX_WARPS, elems // 512))
    return Tiles(False, block_t, block_d, block_hq, block_hk, warps)


def rope_launch(
    q: torch.Tensor | None,
    k: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    qo: torch.Tensor | None,
    ko: torch.Tensor | None,
    backward: bool,
    interleaved: bool = False,
) -> None:
    """Write rot(q) into qo and rot(k) into ko (either pair may be None); ``backward`` rotates by
    -sin (the gradient). All tensors as [B, H, T, D] / [B or 1, T, R], any strides; R < D rotates
    the first R features and copies the rest; ``interleaved`` pairs (2i, 2i+1)."""
    ref = q if q is not None else k
    if ref is None:
        return
    b, _, t, d = ref.shape
    hq = q.shape[1] if q is not None else 0
    hk = k.shape[1] if k is not None else 0
    if b * t == 0 or hq + hk == 0:
        return
    rot = cos.shape[-1]
    half = rot // 2
    tiles = _tiles(t, hq, hk, half)
    n_tblocks = _cdiv(t, tiles.block_t)
    qa, qoa = (q, qo) if q is not None else (k, ko)  # placeholders when absent (HQ = 0: never read)
    ka, koa = (k, ko) if k is not None else (q, qo)
    assert qoa is not None and koa is not None
    cs, ss = cos.stride(), sin.stride()  # one stride() call per tensor: each is a host op
    launch(
        tiles.kernel, (tiles.programs(b, t, hq, hk),),
        qa, ka, qoa, koa, cos, sin, t, n_tblocks, hq, hk,
        *qa.stride(), *ka.stride(), *qoa.stride(), *koa.stride(),
        cs[0] if cos.shape[0] != 1 else 0, cs[1], cs[2],
        ss[0] if sin.shape[0] != 1 else 0, ss[1], ss[2],
        HALF=half, BLOCK_T=tiles.block_t, BLOCK_D=tiles.block_d, BLOCK_HQ=tiles.block_hq, BLOCK_HK=tiles.block_hk,
        BACKWARD=backward, num_warps=tiles.warps,
        **({} if rot == d and not interleaved else {"INTERLEAVED": interleaved, "PASS": d - rot}),
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Registered impl


_Rope, _forward = rope_function(rope_launch)  # the autograd node, shared with the other kernel backends


_lean_apply = lean_apply(_Rope)  # _Rope.apply without its Python wrapper (see _autograd.py)


class _NativePlan:
    """The C++ path's plan for one (device, T's next power of two, HQ, HK, D): the forward and
    backward slots, the positions per program, and whether a program takes one head (rows)."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor) -> None:
        _, hq, t, d = q.shape
        tiles = _tiles(t, hq, k.shape[1], d // 2)
        self.block_t, self.per_head = tiles.block_t, tiles.rows
        meta = dict(
            HALF=d // 2,
            BLOCK_T=tiles.block_t,
            BLOCK_D=tiles.block_d,
            BLOCK_HQ=tiles.block_hq,
            BLOCK_HK=tiles.block_hk,
            num_warps=tiles.warps,
        )
        self.fwd = _native.slot(tiles.kernel, BACKWARD=False, **meta)
        self.bwd = _native.slot(tiles.kernel, BACKWARD=True, **meta)


def rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int | None = None, interleaved: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The registered impl (arguments already validated by ``polykernel.rope``)."""
    if interleaved or cos.size(-1) != q.size(-1):  # (size(-1): no torch.Size built on the hot path)
        # the options: the Python path (the C++ plans know the default kernel only, and read
        # cos/sin as wide as the head)
        return _rope_options(q, k, cos, sin, interleaved)
    if _native.ENABLED:
        out = _native.call("rope", (q, k, cos, sin), (q, k), _NativePlan)
        if out is not None:
            return out
    if _transforms_active():  # functorch (vmap, grad): the kernels cannot read its wrapped tensors
        return _torch_rope(q, k, cos, sin)
    if (q.requires_grad or k.requires_grad or cos.requires_grad or sin.requires_grad) and torch.is_grad_enabled():
        if cos.requires_grad or sin.requires_grad:
            # The dispatcher never picks this impl then (the op's predicate); refuse a direct call
            # rather than return results whose cos/sin gradients would silently be missing.
            raise NotImplementedError("embedding.rope [triton]: no cos/sin gradients; use impl='torch'")
        if q.requires_grad or k.requires_grad:
            return _lean_apply(q, k, cos, sin)
    return _forward(q, k, cos, sin)


def _rope_options(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial or interleaved rotary: the Python path (the C++ plans know the default kernel only)."""
    if _transforms_active():
        return _torch_rope(q, k, cos, sin, None, interleaved)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or cos.requires_grad or sin.requires_grad):
        if cos.requires_grad or sin.requires_grad:
            raise NotImplementedError("embedding.rope [triton]: no cos/sin gradients; use impl='torch'")
        return _lean_apply(q, k, cos, sin, interleaved)
    return _forward(q, k, cos, sin, interleaved)
