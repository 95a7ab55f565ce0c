"""RoPE fused with a static KV cache's write, for ``patch(mode="inference")``'s attention (a
private helper of the inference integration, not an op).

One launch does what the unfused attention does in three (``polykernel.rope`` on q and k, then
the cache's two ``index_copy_``) and reads the positions from the cache's own device counter
(transformers' ``StaticLayer.cumulative_length``), where the cache builds them with two more
launches (``arange + cumulative_length``):

- q heads: rotated into a new ``[B, T, Hq, D]`` tensor (returned as its ``[B, Hq, T, D]`` view,
  the layout ``polykernel.rope`` gives q of the projection's transposed view);
- k heads: rotated into ``key_cache[b, h, cumulative_length + t]``;
- v heads: copied into ``value_cache[b, h, cumulative_length + t]``.

The rotation is ``polykernel.rope``'s (rotate-half, both halves of cos/sin read, fp32, rounded
once): ``o1 = x1·c1 - x2·s1``, ``o2 = x2·c2 + x1·s2``, the same expressions as its Triton kernel.
q, k and v are read from the merged QKV projection's output ``[B, T, (Hq + 2·Hk)·D]`` through
its strides (no copy). The caller advances the counter afterwards (``cumulative_length.add_``):
every program reads it, so no program may write it.

A position outside the cache (``[0, max_cache_len)``) writes nothing into the cache, and that
token's rotated q is NaN: on CUDA, checking would need a sync (``index_copy_`` stops the process
there with a device-side assert); on the CPU the launcher raises ``IndexError`` first, as
``index_copy_`` does. One launch, one allocation (q's, from the caching allocator), no sync:
CUDA-graph safe.

Grid: (token, block of heads), the head blocks of q first, then k's, then v's. A program loads
its token's position and cos/sin row once, then handles BLOCK_H heads of up to BLOCK_D pairs.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._launch import launch
from ._rows import cdiv as _cdiv
from ._rows import next_pow2 as _next_pow2

PAIRS = 1024  # pairs per program (BLOCK_H x BLOCK_D), as rotary_embedding_'s kernel


# ---------------------------------------------------------------------------------------------
# Kernel


@triton.jit
def _rope_kv_kernel(
    QKV, COS, SIN, CUM, QO, KC, VC,
    T, HQ, HK, nq, nk, L,
    sx_b, sx_t, sx_h, sx_d,
    sc_b, sc_t, sc_d, ss_b, ss_t, ss_d,
    so_b, so_t, so_h, so_d,
    sk_b, sk_h, sk_l, sk_d,
    sv_b, sv_h, sv_l, sv_d,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)  # b * T + t
    hb = tl.program_id(1)
    b = row // T
    t = row % T
    pos = tl.load(CUM).to(tl.int64) + t
    ok = (pos >= 0) & (pos < L)
    hk_ok = tl.where(ok, HK, 0)  # no k or v head is written at a position outside the cache
    d = tl.arange(0, BLOCK_D).to(tl.int64)[None, :]
    hh = tl.arange(0, BLOCK_H).to(tl.int64)[:, None]
    x_row = QKV + b * sx_b + t * sx_t
    if hb < nq + nk:  # q or k: rotate
        c_row = COS + b * sc_b + t * sc_t
        s_row = SIN + b * ss_b + t * ss_t
        dm = d < HALF
        c1 = tl.load(c_row + d * sc_d, mask=dm, other=0.0).to(tl.float32)
        c2 = tl.load(c_row + (d + HALF) * sc_d, mask=dm, other=0.0).to(tl.float32)
        s1 = tl.load(s_row + d * ss_d, mask=dm, other=0.0).to(tl.float32)
        s2 = tl.load(s_row + (d + HALF) * ss_d, mask=dm, other=0.0).to(tl.float32)
        if hb < nq:
            h = hb.to(tl.int64) * BLOCK_H + hh
            mask = (h < HQ) & dm
            px = x_row + h * sx_h
            x1 = tl.load(px + d * sx_d, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(px + (d + HALF) * sx_d, mask=mask, other=0.0).to(tl.float32)
            o1 = tl.where(ok, x1 * c1 - x2 * s1, float("nan"))
            o2 = tl.where(ok, x2 * c2 + x1 * s2, float("nan"))
            po = QO + b * so_b + t * so_t + h * so_h
            tl.store(po + d * so_d, o1.to(QO.dtype.element_ty), mask=mask)
            tl.store(po + (d + HALF) * so_d, o2.to(QO.dtype.element_ty), mask=mask)
        else:  # (each branch's names are its own: compiled Triton unifies names across branches)
            hk = (hb - nq).to(tl.int64) * BLOCK_H + hh
            kmask = (hk < hk_ok) & dm
            pk = x_row + (HQ + hk) * sx_h
            k1 = tl.load(pk + d * sx_d, mask=kmask, other=0.0).to(tl.float32)
            k2 = tl.load(pk + (d + HALF) * sx_d, mask=kmask, other=0.0).to(tl.float32)
            pkc = KC + b * sk_b + hk * sk_h + tl.where(ok, pos, 0) * sk_l
            tl.store(pkc + d * sk_d, (k1 * c1 - k2 * s1).to(KC.dtype.element_ty), mask=kmask)
            tl.store(pkc + (d + HALF) * sk_d, (k2 * c2 + k1 * s2).to(KC.dtype.element_ty), mask=kmask)
    else:  # v: copy
        hv = (hb - nq - nk).to(tl.int64) * BLOCK_H + hh
        e = tl.arange(0, 2 * BLOCK_D).to(tl.int64)[None, :]
        vmask = (hv < hk_ok) & (e < 2 * HALF)
        v = tl.load(x_row + (HQ + HK + hv) * sx_h + e * sx_d, mask=vmask, other=0.0)
        pv = VC + b * sv_b + hv * sv_h + tl.where(ok, pos, 0) * sv_l
        tl.store(pv + e * sv_d, v.to(VC.dtype.element_ty), mask=vmask)


# ---------------------------------------------------------------------------------------------
# Host launcher


@functools.lru_cache(maxsize=1024)  # host time: the same few shapes on every call
def _tiles(h: int, half: int) -> tuple[int, int, int]:
    """(BLOCK_H, BLOCK_D, num_warps) for heads of ``half`` pairs: all pairs of a head in one
    tile, about PAIRS pairs per program."""
    block_d = _next_pow2(half)
    block_h = min(_next_pow2(max(h, 1)), max(1, PAIRS // block_d))
    return block_h, block_d, max(1, min(4, block_h * block_d // 256))


def _table(t: torch.Tensor) -> tuple[int, int, int]:
    """A ``[B or 1, T, D]`` table's strides, batch stride 0 where it broadcasts."""
    return (0 if t.shape[0] == 1 else t.stride(0)), t.stride(1), t.stride(2)


def rope_kv_write(
    qkv: torch.Tensor,
    heads_q: int,
    heads_kv: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cumulative_length: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
) -> torch.Tensor:
    """Rotate q and k of ``qkv`` (``[B, T, (heads_q + 2·heads_kv)·D]``, q's heads then k's then
    v's) by ``cos``/``sin`` (``[B or 1, T, D]``), write k and v into the caches (``[B, heads_kv,
    L, D]``) at ``cumulative_length + t``, and return rotated q as ``[B, heads_q, T, D]``. The
    caller checked the shapes, dtypes and devices (see ``integrations.transformers._fused_attention``)."""
    b, t, width = qkv.shape
    d = width // (heads_q + 2 * heads_kv)
    x = qkv.view(b, t, heads_q + 2 * heads_kv, d)
    q = torch.empty((b, t, heads_q, d), dtype=qkv.dtype, device=qkv.device)
    length = key_cache.shape[2]
    if qkv.device.type == "cpu":  # free to check here (no sync): the error index_copy_ gives
        start = int(cumulative_length)
        if start < 0 or start + t > length:
            raise IndexError(f"rope_kv_write: cache positions [{start}, {start + t}) are out of bounds for a cache of {length}")
    if b * t == 0:
        return q.transpose(1, 2)
    half = d // 2
    block_h, block_d, warps = _tiles(max(heads_q, heads_kv), half)
    nq, nk = _cdiv(heads_q, block_h), _cdiv(heads_kv, block_h)
    launch(
        _rope_kv_kernel, (b * t, nq + 2 * nk),
        x, cos, sin, cumulative_length, q, key_cache, value_cache,
        t, heads_q, heads_kv, nq, nk, length,
        *x.stride(), *_table(cos), *_table(sin), *q.stride(), *key_cache.stride(), *value_cache.stride(),
        HALF=half, BLOCK_H=block_h, BLOCK_D=block_d, num_warps=warps,
    )  # fmt: skip
    return q.transpose(1, 2)
