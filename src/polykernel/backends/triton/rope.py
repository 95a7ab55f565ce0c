"""Triton RoPE (rotate-half): forward and backward (dq, dk) with one kernel.

One program takes a tile of BLOCK_T consecutive positions of one batch row and every head of q
and of k: cos/sin for those positions are loaded once (per BLOCK_D chunk of the half dim) and
reused across all heads. Each head row is read as its two halves x1 = x[:D/2], x2 = x[D/2:]:

    forward:  o1 = x1·c1 - x2·s1      o2 = x2·c2 + x1·s2
    backward: o1 = g1·c1 + g2·s2      o2 = g2·c2 - g1·s1   (the transposed rotation, by -sin)

Every tensor is addressed through its own strides (q/k/outputs as [B, H, T, D], cos/sin as
[B, T, D] with batch stride 0 when broadcast), so HF's transposed views [B, T, H, D].transpose(1, 2)
and slices of a fused QKV projection run without a copy; outputs keep q's/k's dense layout
(``empty_like``). Math is fp32; no atomics, so the backward is deterministic. This impl computes
no cos/sin gradient: the op's predicate keeps it from being selected when cos/sin need one.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ...ops.rope import reference  # noqa: F401  (semantics live in the op file)
from ..torch._functions import rope_function
from ._autograd import lean_apply
from ._launch import launch
from ._rows import cdiv as _cdiv
from ._rows import next_pow2 as _next_pow2

# elements per half-tile [BLOCK_T, BLOCK_H, BLOCK_D] (two halves per head row), and the warps that
# share one. 1024 elements on 1 warp: q 4x32x4096x128 bf16 fwd 3.73 TB/s, fwd+bwd 3.72, against
# 3.40 / 3.40 at 2048 on up to 4 warps (H200, kernel_variants.py, 2026-11-30)
ELEMS = 1024
MAX_BLOCK_D = 128  # half dims up to 128 (D <= 256) in one chunk; longer ones are walked in chunks
MAX_WARPS = 1  # benchmarks/kernel_variants.py A/Bs these three (call _tiles.cache_clear() after a change)


# ---------------------------------------------------------------------------------------------
# Kernels


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
):
    """Rotate heads [0, H) of the rows at x_base ([BLOCK_T, 1, 1] offsets) for the d chunk."""
    d3 = d[None, None, :]
    td_ok = t_ok[:, None, None] & d_ok[None, None, :]
    for h0 in range(0, H, BLOCK_H):
        h = tl.cast(h0, tl.int64) + tl.arange(0, BLOCK_H).to(tl.int64)
        h3 = h[None, :, None]
        mask = td_ok & (h < H)[None, :, None]
        px = X + x_base + h3 * sx_h
        x1 = tl.load(px + d3 * sx_d, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(px + (d3 + HALF) * sx_d, mask=mask, other=0.0).to(tl.float32)
        o1 = x1 * c1 - x2 * sa
        o2 = x2 * c2 + x1 * sb
        po = OUT + o_base + h3 * so_h
        tl.store(po + d3 * so_d, o1.to(OUT.dtype.element_ty), mask=mask)
        tl.store(po + (d3 + HALF) * so_d, o2.to(OUT.dtype.element_ty), mask=mask)


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
        m = t_ok[:, None] & d_ok[None, :]
        c1 = tl.load(c_row + d[None, :] * sc_d, mask=m, other=0.0).to(tl.float32)[:, None, :]
        c2 = tl.load(c_row + (d[None, :] + HALF) * sc_d, mask=m, other=0.0).to(tl.float32)[:, None, :]
        s1 = tl.load(s_row + d[None, :] * ss_d, mask=m, other=0.0).to(tl.float32)[:, None, :]
        s2 = tl.load(s_row + (d[None, :] + HALF) * ss_d, mask=m, other=0.0).to(tl.float32)[:, None, :]
        if BACKWARD:
            sa = -s2
            sb = -s1
        else:
            sa = s1
            sb = s2
        _rot_heads(Q, QO, q_base, qo_base, HQ, sq_h, sq_d, sqo_h, sqo_d, t_ok, d, d_ok, c1, c2, sa, sb, HALF, BLOCK_HQ)
        _rot_heads(K, KO, k_base, ko_base, HK, sk_h, sk_d, sko_h, sko_d, t_ok, d, d_ok, c1, c2, sa, sb, HALF, BLOCK_HK)


# ---------------------------------------------------------------------------------------------
# Host launcher


def _pow2(n: int) -> int:
    return _next_pow2(max(n, 1))


@functools.lru_cache(maxsize=4096)  # host time: the same few shapes on every call
def _tiles(t: int, hq: int, hk: int, half: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_T, BLOCK_D, BLOCK_HQ, BLOCK_HK, num_warps): ~ELEMS elements per half-tile, all heads
    of one position in one tile where they fit, and several positions per program when a
    position is small."""
    block_d = min(_pow2(half), MAX_BLOCK_D)
    cap_h = max(1, ELEMS // block_d)
    block_hq = min(_pow2(hq), cap_h)
    block_hk = min(_pow2(hk), cap_h)
    block_t = min(_pow2(t), max(1, ELEMS // (max(block_hq, block_hk) * block_d)))
    elems = block_t * max(block_hq, block_hk) * block_d
    warps = max(1, min(MAX_WARPS, elems // 512))
    return block_t, block_d, block_hq, block_hk, warps


def rope_launch(
    q: torch.Tensor | None,
    k: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    qo: torch.Tensor | None,
    ko: torch.Tensor | None,
    backward: bool,
) -> None:
    """Write rot(q) into qo and rot(k) into ko (either pair may be None); ``backward`` rotates by
    -sin (the gradient). All tensors as [B, H, T, D] / [B or 1, T, D], any strides."""
    ref = q if q is not None else k
    if ref is None:
        return
    b, _, t, d = ref.shape
    hq = q.shape[1] if q is not None else 0
    hk = k.shape[1] if k is not None else 0
    if b * t == 0 or hq + hk == 0:
        return
    half = d // 2
    block_t, block_d, block_hq, block_hk, warps = _tiles(t, hq, hk, half)
    n_tblocks = _cdiv(t, block_t)
    qa, qoa = (q, qo) if q is not None else (k, ko)  # placeholders when absent (HQ = 0: never read)
    ka, koa = (k, ko) if k is not None else (q, qo)
    assert qoa is not None and koa is not None
    cs, ss = cos.stride(), sin.stride()  # one stride() call per tensor: each is a host op
    launch(
        _rope_kernel, (b * n_tblocks,),
        qa, ka, qoa, koa, cos, sin, t, n_tblocks, hq, hk,
        *qa.stride(), *ka.stride(), *qoa.stride(), *koa.stride(),
        cs[0] if cos.shape[0] != 1 else 0, cs[1], cs[2],
        ss[0] if sin.shape[0] != 1 else 0, ss[1], ss[2],
        HALF=half, BLOCK_T=block_t, BLOCK_D=block_d, BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BACKWARD=backward,
        num_warps=warps,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Registered impl


_Rope, _forward = rope_function(rope_launch)  # the autograd node, shared with the other kernel backends


_lean_apply = lean_apply(_Rope)  # _Rope.apply without its Python wrapper (see _autograd.py)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The registered impl (arguments already validated by ``polykernel.rope``)."""
    if (q.requires_grad or k.requires_grad or cos.requires_grad or sin.requires_grad) and torch.is_grad_enabled():
        if cos.requires_grad or sin.requires_grad:
            # The dispatcher never picks this impl then (the op's predicate); refuse a direct call
            # rather than return results whose cos/sin gradients would silently be missing.
            raise NotImplementedError("embedding.rope [triton]: no cos/sin gradients; use impl='torch'")
        if q.requires_grad or k.requires_grad:
            return _lean_apply(q, k, cos, sin)
    return _forward(q, k, cos, sin)
