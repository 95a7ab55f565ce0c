"""Triton rotary_embedding_ (vLLM's serving layout): gather cos/sin by position, rotate in place.

The training rope kernel (``rope.py``) reads cos/sin tensors laid out per position, full width;
here each token's row of ``cos_sin_cache [max_pos, rotary_dim]`` (cat(cos, sin), half width each)
is gathered through ``positions``, pairs are NeoX (``i, i + rotary_dim/2``) or GPT-J (``2i, 2i+1``),
and only the first ``rotary_dim`` features of a head rotate: a small kernel of its own, same math
(``o1 = x1·c - x2·s``, ``o2 = x2·c + x1·s`` in fp32, each rounded once).

Grid: (token, block of heads), the head blocks of q first, then k's, so q and k rotate in one
launch. A program loads its token's position and cos/sin row once, then rotates BLOCK_H heads of
up to BLOCK_D pairs. Every tensor is addressed through its strides (q/k as [T, H, head_size]: the
slices of a fused QKV projection need no copy), positions and offsets in int64. A position
outside [0, max_pos) reads row 0 and writes NaN into that token's rotated features (the op's
contract on CUDA, where checking it would need a sync). One launch, no allocation: CUDA-graph safe.
On CUDA tensors it launches from C++ when the native path is on (:class:`_NativePlan`).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ...ops.rotary_embedding_ import heads
from . import _native
from ._launch import launch
from ._rows import cdiv as _cdiv
from ._rows import next_pow2 as _next_pow2

PAIRS = 1024  # pairs per program (BLOCK_H x BLOCK_D): 2048 values of q or k


# ---------------------------------------------------------------------------------------------
# Kernel


@triton.jit
def _rotate(X, t, h0, H, sx_t, sx_h, sx_d, c, s, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, NEOX: tl.constexpr):
    """Rotate heads [h0, h0 + BLOCK_H) of token t of X (c, s: [1, BLOCK_D] fp32)."""
    h = h0 + tl.arange(0, BLOCK_H).to(tl.int64)
    d = tl.arange(0, BLOCK_D).to(tl.int64)
    mask = (h < H)[:, None] & (d < HALF)[None, :]
    row = X + t * sx_t + h[:, None] * sx_h
    if NEOX:
        p1 = row + d[None, :] * sx_d
        p2 = row + (d[None, :] + HALF) * sx_d
    else:
        p1 = row + (2 * d[None, :]) * sx_d
        p2 = row + (2 * d[None, :] + 1) * sx_d
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    tl.store(p1, (x1 * c - x2 * s).to(X.dtype.element_ty), mask=mask)
    tl.store(p2, (x2 * c + x1 * s).to(X.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    POS, Q, K, CACHE,
    HQ, HK, nq_blocks, max_pos,
    s_pos, sq_t, sq_h, sq_d, sk_t, sk_h, sk_d, sc_p, sc_d,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, NEOX: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    pos = tl.load(POS + t * s_pos).to(tl.int64)
    ok = (pos >= 0) & (pos < max_pos)
    row = CACHE + tl.where(ok, pos, 0) * sc_p
    d = tl.arange(0, BLOCK_D)
    dm = d < HALF
    c = tl.load(row + d * sc_d, mask=dm, other=0.0).to(tl.float32)
    s = tl.load(row + (d + HALF) * sc_d, mask=dm, other=0.0).to(tl.float32)
    c = tl.where(ok, c, float("nan"))[None, :]
    s = tl.where(ok, s, float("nan"))[None, :]
    if hb < nq_blocks:
        _rotate(Q, t, hb.to(tl.int64) * BLOCK_H, HQ, sq_t, sq_h, sq_d, c, s, HALF, BLOCK_H, BLOCK_D, NEOX)
    else:
        _rotate(K, t, (hb - nq_blocks).to(tl.int64) * BLOCK_H, HK, sk_t, sk_h, sk_d, c, s, HALF, BLOCK_H, BLOCK_D, NEOX)


# ---------------------------------------------------------------------------------------------
# Host launcher


@functools.lru_cache(maxsize=1024)  # host time: the same few shapes on every call
def _tiles(h: int, half: int) -> tuple[int, int, int]:
    """(BLOCK_H, BLOCK_D, num_warps) for heads of ``half`` pairs: all pairs of a head in one
    tile, about PAIRS pairs per program."""
    block_d = _next_pow2(half)
    block_h = min(_next_pow2(max(h, 1)), max(1, PAIRS // block_d))
    return block_h, block_d, max(1, min(4, block_h * block_d // 256))


def rotary_launch(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None, head_size: int, cache: torch.Tensor, is_neox: bool
) -> None:
    """Rotate query and key (either layout, any strides) in place; one launch."""
    tokens = positions.shape[0]
    q3 = heads(query, head_size)
    k3 = heads(key, head_size) if key is not None else q3  # absent: a placeholder with HK = 0
    hq, hk = q3.shape[1], (k3.shape[1] if key is not None else 0)
    if tokens == 0 or hq + hk == 0:
        return
    half = cache.shape[1] // 2
    block_h, block_d, warps = _tiles(max(hq, hk), half)
    nq = _cdiv(hq, block_h)
    grid = (tokens, nq + _cdiv(hk, block_h))
    launch(
        _rotary_kernel, grid,
        positions, q3, k3, cache, hq, hk, nq, cache.shape[0],
        positions.stride(0), *q3.stride(), *k3.stride(), *cache.stride(),
        HALF=half, BLOCK_H=block_h, BLOCK_D=block_d, NEOX=is_neox, num_warps=warps,
    )  # fmt: skip


class _NativePlan:
    """The C++ path's plan for one (heads, half width, pair layout): the kernel's slot and BLOCK_H."""

    def __init__(self, n_heads: int, half: int, is_neox: bool) -> None:
        self.block_h, block_d, warps = _tiles(n_heads, half)
        self.fwd = _native.slot(_rotary_kernel, HALF=half, BLOCK_H=self.block_h, BLOCK_D=block_d, NEOX=is_neox, num_warps=warps)


def _native_plan(query: torch.Tensor, key: torch.Tensor | None, head_size: int, cache: torch.Tensor, is_neox: bool) -> _NativePlan:
    hq = heads(query, head_size).shape[1]
    hk = heads(key, head_size).shape[1] if key is not None else 0
    return _NativePlan(max(hq, hk), cache.shape[1] // 2, is_neox)


# ---------------------------------------------------------------------------------------------
# Registered impl


def rotary_embedding_(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
    rotary_dim: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The registered impl (arguments already validated by ``polykernel.rotary_embedding_``)."""
    if _native.ENABLED:
        args = (positions, query, key, head_size, cos_sin_cache, is_neox)
        if _native.call("rotary_embedding", args, args[1:], _native_plan) is not None:
            return query, key
    rotary_launch(positions, query, key, head_size, cos_sin_cache, is_neox)
    return query, key
