"""cuTile RoPE (rotate-half): forward and backward (dq, dk) with one kernel.

One block takes TT consecutive positions of one batch row and walks every head of q, then of k;
cos/sin for those positions are loaded once and reused across heads. Each head row is read as its
two halves x1 = x[:D/2], x2 = x[D/2:] through element-index gathers, so any D (a power of two or
not) and any strides work without a copy: q/k and their outputs as [B, H, T, D] (HF's transposed
[B, T, H, D] views, slices of a fused QKV, a strided last dim), cos/sin as [B or 1, T, D]:

    forward:  o1 = x1·c1 - x2·s1      o2 = x2·c2 + x1·s2
    backward: o1 = g1·c1 + g2·s2      o2 = g2·c2 - g1·s1   (the transposed rotation)

Out-of-range positions and padded half-dim lanes are dropped by the gathers' bounds checks and
the stores' mask. Math in fp32; no atomics. No cos/sin gradient: the op's predicate keeps this
impl from being selected when cos/sin require grad.
"""

from __future__ import annotations

import cuda.tile as ct
import torch

from ._host import launch, pow2

TILE_ELEMS = 2048  # elements per half-tile [TT, TD]


# ---------------------------------------------------------------------------------------------
# Kernel


@ct.function
def _rotate(X, OUT, b, h, t, d, d2, ok, c1, c2, a1, a2):
    x1 = ct.astype(ct.gather(X, (b, h, t, d)), ct.float32)
    x2 = ct.astype(ct.gather(X, (b, h, t, d2)), ct.float32)
    ct.scatter(OUT, (b, h, t, d), ct.astype(x1 * c1 + x2 * a1, OUT.dtype), mask=ok)
    ct.scatter(OUT, (b, h, t, d2), ct.astype(x2 * c2 + x1 * a2, OUT.dtype), mask=ok)


@ct.kernel
def _rope_kernel(Q, K, QO, KO, COS, SIN, HQ: int, HK: int, COS_B: ct.Constant[int], SIN_B: ct.Constant[int],
                 HALF: ct.Constant[int], TT: ct.Constant[int], TD: ct.Constant[int], BACKWARD: ct.Constant[bool]):  # fmt: skip
    b, tb = ct.bid(0), ct.bid(1)
    t = ct.reshape(ct.arange(TT, dtype=ct.int32) + tb * TT, (TT, 1))
    d = ct.reshape(ct.arange(TD, dtype=ct.int32), (1, TD))
    d2 = d + HALF
    ok = d < HALF
    cb, sb = b * COS_B, b * SIN_B
    c1 = ct.astype(ct.gather(COS, (cb, t, d)), ct.float32)
    c2 = ct.astype(ct.gather(COS, (cb, t, d2)), ct.float32)
    s1 = ct.astype(ct.gather(SIN, (sb, t, d)), ct.float32)
    s2 = ct.astype(ct.gather(SIN, (sb, t, d2)), ct.float32)
    # o1 = x1·c1 + x2·a1, o2 = x2·c2 + x1·a2
    if BACKWARD:
        a1, a2 = s2, -s1
    else:
        a1, a2 = -s1, s2
    for h in range(HQ):
        _rotate(Q, QO, b, h, t, d, d2, ok, c1, c2, a1, a2)
    for h in range(HK):
        _rotate(K, KO, b, h, t, d, d2, ok, c1, c2, a1, a2)


# ---------------------------------------------------------------------------------------------
# Host launcher


def rope_launch(
    q: torch.Tensor | None,
    k: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    qo: torch.Tensor | None,
    ko: torch.Tensor | None,
    backward: bool,
) -> None:
    """Write rot(q) into qo and rot(k) into ko (either pair may be None); ``backward`` applies the
    transposed rotation. All tensors as [B, H, T, D] / [B or 1, T, D], any strides."""
    ref = q if q is not None else k
    if ref is None:
        return
    b, _, t, d = ref.shape
    hq = q.shape[1] if q is not None else 0
    hk = k.shape[1] if k is not None else 0
    if b * t * d == 0 or hq + hk == 0:
        return
    # a side without heads (absent, or H = 0) gets the other side's arrays as placeholders: never read
    side = (q, qo) if hq else (k, ko)
    qa, qoa = (q, qo) if hq else side
    ka, koa = (k, ko) if hk else side
    half = d // 2
    td = pow2(half)
    tt = min(pow2(t), max(1, TILE_ELEMS // td))
    cos_b, sin_b = int(cos.shape[0] != 1), int(sin.shape[0] != 1)
    launch((b, (t + tt - 1) // tt), _rope_kernel, qa, ka, qoa, koa, cos, sin, hq, hk, cos_b, sin_b, half, tt, td, backward)


def _forward(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    qo, ko = torch.empty_like(q), torch.empty_like(k)  # q's / k's dense layout (no copy of a view)
    rope_launch(q, k, cos, sin, qo, ko, backward=False)
    return qo, ko


# ---------------------------------------------------------------------------------------------
# Registered impl


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):  # type: ignore[override]
        qo, ko = _forward(q, k, cos, sin)
        ctx.save_for_backward(cos, sin)
        ctx.layouts = ((q.shape, qo.stride()), (k.shape, ko.stride()))
        ctx.set_materialize_grads(False)
        return qo, ko

    @staticmethod
    def backward(ctx, gq, gk):  # type: ignore[override]
        cos, sin = ctx.saved_tensors
        (q_shape, q_stride), (k_shape, k_stride) = ctx.layouts
        gq = gq if ctx.needs_input_grad[0] else None
        gk = gk if ctx.needs_input_grad[1] else None
        dq = torch.empty_strided(q_shape, q_stride, dtype=gq.dtype, device=gq.device) if gq is not None else None
        dk = torch.empty_strided(k_shape, k_stride, dtype=gk.dtype, device=gk.device) if gk is not None else None
        rope_launch(gq, gk, cos, sin, dq, dk, backward=True)
        return dq, dk, None, None


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The registered impl (arguments already validated by ``polykernel.rope``)."""
    if torch.is_grad_enabled():
        if cos.requires_grad or sin.requires_grad:
            raise NotImplementedError("embedding.rope [cutile]: no cos/sin gradients; use impl='torch'")
        if q.requires_grad or k.requires_grad:
            return _Rope.apply(q, k, cos, sin)
    return _forward(q, k, cos, sin)
