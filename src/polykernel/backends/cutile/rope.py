"""cuTile RoPE (rotate-half): forward and backward (dq, dk), one kernel per direction.

One block takes TT consecutive positions of one batch row and walks every head of q, then of k;
cos/sin for those positions are loaded once and reused across heads. Each head row is read as its
two halves x1 = x[:D/2], x2 = x[D/2:]. Any strides work without a copy: q/k and their outputs as
[B, H, T, D] (HF's transposed [B, T, H, D] views, slices of a fused QKV, a strided last dim),
cos/sin as [B or 1, T, D]. Two kernels:

* tiled (D/2 a power of two: D = 64, 128, 256, ...): the halves are the tiles (0 and 1) of the last
  dim partitioned by D/2, read by ``ct.load`` as ``[TT, D/2]`` blocks (contiguous vector loads
  when the last stride is 1; no TMA: each tile is streamed once);
* gathered (any other D): element-index gathers and masked scatters.

    forward:  o1 = x1·c1 - x2·s1      o2 = x2·c2 + x1·s2
    backward: o1 = g1·c1 + g2·s2      o2 = g2·c2 - g1·s1   (the transposed rotation)

Out-of-range positions (and, gathered, padded half-dim lanes) are dropped by the stores' bounds
checks and masks. Math in fp32; no atomics. No cos/sin gradient: the op's predicate keeps this
impl from being selected when cos/sin require grad.
"""

from __future__ import annotations

import cuda.tile as ct
import torch

from .._functions import rope_function
from ._host import launch, num_sms, pow2

TILE_ELEMS = 1024  # elements per half-tile [TT, TD] (tiled, sm_90: about 90 registers at 128 threads; 2048: 164)
ZERO = ct.PaddingMode.ZERO


# ---------------------------------------------------------------------------------------------
# Kernel


@ct.function
def _half(A, index, shape, TT, TD):
    """One half-tile of A (the tile ``index`` of shape ``shape``) as [TT, TD] fp32."""
    t = ct.load(A, index=index, shape=shape, padding_mode=ZERO, allow_tma=False)
    return ct.astype(ct.reshape(t, (TT, TD)), ct.float32)


@ct.function
def _rotate_tiles(X, OUT, b, h, tb, TT, TD, c1, c2, a1, a2):
    x1 = _half(X, (b, h, tb, 0), (1, 1, TT, TD), TT, TD)
    x2 = _half(X, (b, h, tb, 1), (1, 1, TT, TD), TT, TD)
    o1 = ct.reshape(ct.astype(x1 * c1 + x2 * a1, OUT.dtype), (1, 1, TT, TD))
    o2 = ct.reshape(ct.astype(x2 * c2 + x1 * a2, OUT.dtype), (1, 1, TT, TD))
    ct.store(OUT, index=(b, h, tb, 0), tile=o1, allow_tma=False)
    ct.store(OUT, index=(b, h, tb, 1), tile=o2, allow_tma=False)


@ct.kernel
def _rope_tiled(Q, K, QO, KO, COS, SIN, HQ: int, HK: int, COS_B: ct.Constant[int], SIN_B: ct.Constant[int],
                TT: ct.Constant[int], TD: ct.Constant[int], BACKWARD: ct.Constant[bool]):  # fmt: skip
    # TD = D/2 exactly: tile 0 of the last dim is x[:D/2], tile 1 is x[D/2:]
    # grid dim 2 splits the heads into groups (block g takes heads g, g + G, ...): enough blocks to
    # fill the GPU when B x T/TT is small, while each block still reuses its cos/sin tiles
    b, tb, g, groups = ct.bid(0), ct.bid(1), ct.bid(2), ct.num_blocks(2)
    cb, sb = b * COS_B, b * SIN_B
    c1 = _half(COS, (cb, tb, 0), (1, TT, TD), TT, TD)
    c2 = _half(COS, (cb, tb, 1), (1, TT, TD), TT, TD)
    s1 = _half(SIN, (sb, tb, 0), (1, TT, TD), TT, TD)
    s2 = _half(SIN, (sb, tb, 1), (1, TT, TD), TT, TD)
    if BACKWARD:
        a1, a2 = s2, -s1
    else:
        a1, a2 = -s1, s2
    for h in range(g, HQ, groups):
        _rotate_tiles(Q, QO, b, h, tb, TT, TD, c1, c2, a1, a2)
    for h in range(g, HK, groups):
        _rotate_tiles(K, KO, b, h, tb, TT, TD, c1, c2, a1, a2)


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
    if d == 2 * td:  # D/2 a power of two: the halves are whole tiles
        tb = (t + tt - 1) // tt
        sms = num_sms(ref.device.index if ref.device.index is not None else torch.cuda.current_device())
        groups = max(1, min(max(hq, hk), -(-8 * sms // (b * tb))))  # about 8 blocks per SM in all
        launch((b, tb, groups), _rope_tiled, qa, ka, qoa, koa, cos, sin, hq, hk, cos_b, sin_b, tt, td, backward)
        return
    launch((b, (t + tt - 1) // tt), _rope_kernel, qa, ka, qoa, koa, cos, sin, hq, hk, cos_b, sin_b, half, tt, td, backward)


# ---------------------------------------------------------------------------------------------
# Registered impl


_Rope, _forward = rope_function(rope_launch)  # the autograd node, shared with the other kernel backends


def rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int | None = None, interleaved: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The registered impl (arguments already validated by ``polykernel.rope``)."""
    if interleaved or cos.shape[-1] != q.shape[-1]:
        # the op's predicate keeps the dispatcher from picking this impl then; refuse a direct call
        raise NotImplementedError("embedding.rope [cutile]: rotate-half over the whole head only; use impl='triton' or 'torch'")
    if torch.is_grad_enabled():
        if cos.requires_grad or sin.requires_grad:
            raise NotImplementedError("embedding.rope [cutile]: no cos/sin gradients; use impl='torch'")
        if q.requires_grad or k.requires_grad:
            return _Rope.apply(q, k, cos, sin)
    return _forward(q, k, cos, sin)
