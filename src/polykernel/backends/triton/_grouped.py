"""What the Triton MoE experts impls share: the sorted routing, the grouped-GEMM building blocks
and their host code, the autograd plumbing.

The pairs are sorted by expert once per call (:mod:`polykernel.backends._moe_route`: no host
sync) and cut into tiles of ``BM`` rows that never straddle two experts; a tile table (expert and
first row per program, built with torch ops on the device) lets every row-GEMM launch a fixed
grid of ``cdiv(S, BM) + min(E, S)`` row tiles, the surplus programs doing nothing. The backward
reuses the sort and the table. Shared kernels (S = T·k pairs, each GEMM accumulates in fp32 from
operands of the inputs' dtype):

- ``_scatter_kernel``: ``[S, K] x B[e]`` (+ a bias), the routing weight applied (or not), each row
  stored at its pair's place in token order (the scatter back to tokens, fused), so the sum over
  a token's k pairs is a contiguous reduction (no atomics: the same bits every run);
- ``_dw_kernel``: each expert's ``Σ_pairs aᵀ ⊗ b`` over that expert's rows, one program per
  (expert, output tile) walking its rows in order: no atomics, deterministic.

Each op's own kernels (its activation, layout and biases) live in its file
(``moe_experts.py``, ``moe_experts_gpt_oss.py``) and build on the ``@triton.jit`` helpers here.
Tile sizes are a host decision from the problem (:func:`plan`); the CPU interpreter gets small
ones. fp32 operands use IEEE dot products (no TF32: the ops' fp32 error models are fp32's).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from ... import env
from .. import _moe_route as sort
from .._double_backward import graph_grads
from ._autograd import lean_apply
from ._autograd import transforms_active as _transforms_active
from ._launch import launch
from ._rows import cdiv as _cdiv

# ---------------------------------------------------------------------------------------------
# Kernels and their building blocks


@triton.jit
def _dot(a, b, acc, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + a @ b`` in fp32. UPCAST: the CPU interpreter's dot multiplies bf16 operands as
    their raw uint16 bits (Triton 3.9), so there they go in as fp32, whose products of bf16
    values are exact, as a GPU's bf16 MMA with fp32 accumulation computes them."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PREC)


@triton.jit
def _row_tile(TILE_E, TILE_R0, OFFS, BM: tl.constexpr):
    """This program's expert, its rows [BM] in the sorted pairs, and which of them are the expert's."""
    p = tl.program_id(0)
    e = tl.load(TILE_E + p).to(tl.int64)
    r0 = tl.load(TILE_R0 + p).to(tl.int64)
    end = tl.load(OFFS + e + 1).to(tl.int64)
    rows = r0 + tl.arange(0, BM)
    return e, r0, end, rows, rows < end


@triton.jit
def _row_gemm(
    A, arows, rmask, B, K, stride_a, stride_bk, nmask, V,
    ROW_DOT: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """``A[arows] @ B`` ([BM, BN] in fp32; ``B`` the expert's column block, by its K stride) and,
    where ROW_DOT, ``A[arows] · V`` over K ([BM], in fp32; ``V`` a [K] vector), in one pass."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    dot = tl.zeros((BM,), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        kmask = kk < K
        a = tl.load(A + arows[:, None] * stride_a + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(B + kk[:, None] * stride_bk, mask=kmask[:, None] & nmask[None, :], other=0.0)
        acc = _dot(a, b, acc, PREC, UPCAST)
        if ROW_DOT:
            v = tl.load(V + kk, mask=kmask, other=0.0).to(tl.float32)
            dot += tl.sum(a.to(tl.float32) * v[None, :], axis=1)
    return acc, dot


@triton.jit
def _gate_up_gemm(
    X, tok, rmask, W_GATE, W_UP, H, stride_x, stride_wh, nmask,
    PREC: tl.constexpr, UPCAST: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """``x[tok] @ W_GATE`` and ``x[tok] @ W_UP`` side by side (one read of x for both), in fp32;
    the weights' column blocks by their H stride."""
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, H, BK):
        kk = k0 + tl.arange(0, BK)
        kmask = kk < H
        x = tl.load(X + tok[:, None] * stride_x + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        wmask = kmask[:, None] & nmask[None, :]
        wg = tl.load(W_GATE + kk[:, None] * stride_wh, mask=wmask, other=0.0)
        wu = tl.load(W_UP + kk[:, None] * stride_wh, mask=wmask, other=0.0)
        acc_g = _dot(x, wg, acc_g, PREC, UPCAST)
        acc_u = _dot(x, wu, acc_u, PREC, UPCAST)
    return acc_g, acc_u


@triton.jit
def _clamped_swiglu(gate, up, alpha, limit):
    """gpt-oss's activation in fp32: (clamp(up, ±limit) + 1)·g·σ(alpha·g), g = min(gate, limit).
    NaN propagates, as through torch's clamp (tl.minimum's default drops it: a NaN token or
    expert weight came out finite)."""
    g = tl.minimum(gate, limit, propagate_nan=tl.PropagateNan.ALL)
    u = tl.clamp(up, -limit, limit, propagate_nan=tl.PropagateNan.ALL)
    return (u + 1.0) * (g * tl.sigmoid(alpha * g))


@triton.jit
def _clamped_swiglu_bwd(gate, up, alpha, limit):
    """(the activation, d/d gate, d/d up) in fp32; torch's clamp passes the gradient where the
    value is inside the limits, ends included."""
    g = tl.minimum(gate, limit, propagate_nan=tl.PropagateNan.ALL)
    u = tl.clamp(up, -limit, limit, propagate_nan=tl.PropagateNan.ALL)
    sig = tl.sigmoid(alpha * g)
    glu = g * sig
    slope_g = tl.where(gate <= limit, (u + 1.0) * (sig + alpha * g * sig * (1.0 - sig)), 0.0)
    slope_u = tl.where((up >= -limit) & (up <= limit), glu, 0.0)
    return (u + 1.0) * glu, slope_g, slope_u


@triton.jit
def _scatter_kernel(
    A, B, BIAS, PERM, TILE_E, TILE_R0, OFFS, WFLAT, OUT,
    K, N, stride_a, stride_be, stride_bk, stride_bn, stride_biase, stride_out,
    HAS_BIAS: tl.constexpr, WEIGHTED: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """OUT[perm[r]] = (w[perm[r]] ·) (A[r] @ B[e] (+ BIAS[e])) for the sorted rows r of expert e."""
    e, r0, end, rows, rmask = _row_tile(TILE_E, TILE_R0, OFFS, BM)
    if r0 < end:
        pair = tl.load(PERM + rows, mask=rmask, other=0)
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        nmask = n < N
        b_base = B + e * stride_be + n[None, :] * stride_bn
        acc, _ = _row_gemm(A, rows, rmask, b_base, K, stride_a, stride_bk, nmask, A, False, PREC, UPCAST, BM, BN, BK)
        if HAS_BIAS:
            acc += tl.load(BIAS + e * stride_biase + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
        if WEIGHTED:
            acc = acc * tl.load(WFLAT + pair, mask=rmask, other=0.0).to(tl.float32)[:, None]
        tl.store(OUT + pair[:, None] * stride_out + n[None, :], acc.to(OUT.dtype.element_ty), mask=rmask[:, None] & nmask[None, :])


@triton.jit
def _dw_kernel(
    A, B, PERM, OFFS, DW,
    K_TOP, N, K, n_kblocks, stride_a, stride_b, stride_de, stride_dn, stride_dk,
    A_GATHER: tl.constexpr, B_GATHER: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr,
):  # fmt: skip
    """DW[e] = Σ_r A[ra]ᵀ ⊗ B[rb] over expert e's sorted rows r, in order (ra/rb = r, or r's token)."""
    e = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    n = (blk // n_kblocks) * BN + tl.arange(0, BN)
    kk = (blk % n_kblocks) * BK + tl.arange(0, BK)
    nmask = n < N
    kmask = kk < K
    start = tl.load(OFFS + e).to(tl.int64)
    end = tl.load(OFFS + e + 1).to(tl.int64)
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    for r0 in range(start, end, BR):
        r = r0 + tl.arange(0, BR)
        rmask = r < end
        if A_GATHER or B_GATHER:
            tok = tl.load(PERM + r, mask=rmask, other=0) // K_TOP
        if A_GATHER:
            ra = tok
        else:
            ra = r
        if B_GATHER:
            rb = tok
        else:
            rb = r
        a = tl.load(A + ra[None, :] * stride_a + n[:, None], mask=nmask[:, None] & rmask[None, :], other=0.0)  # [BN, BR]
        b = tl.load(B + rb[:, None] * stride_b + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)  # [BR, BK]
        acc = _dot(a, b, acc, PREC, UPCAST)
    out = DW + e * stride_de + n[:, None] * stride_dn + kk[None, :] * stride_dk
    tl.store(out, acc.to(DW.dtype.element_ty), mask=nmask[:, None] & kmask[None, :])


# ---------------------------------------------------------------------------------------------
# Host side: the plan, the route, the shared launches


class Plan(NamedTuple):
    """Tile sizes of one problem: BM rows per row tile (shared by every row GEMM of the call,
    since they share the tile table), BN/BK of the row GEMMs, BN_W/BK_W/BR of the dW walks."""

    bm: int
    bn: int
    bk: int
    bn_w: int
    bk_w: int
    br: int
    warps: int
    stages: int


@functools.lru_cache(maxsize=1024)
def plan(s: int, n_experts: int, h: int, inter: int, elt: int, interpret: bool) -> Plan:
    """Tile sizes from the problem: S pairs over E experts, H, I, the element size.

    The interpreter runs each program as numpy calls: few, 16-row programs (tl.dot's minimum).
    On a GPU: 64-row tiles (128 when the average expert has >= 512 rows, halving the weight
    reads), 64-wide gate/up tiles (two accumulators), 32-deep K steps for fp32 (register and
    shared-memory budget). These are starting points, not measured choices (issue 24's H200
    tables are still to come)."""
    if interpret:
        return Plan(bm=16, bn=32, bk=32, bn_w=32, bk_w=32, br=16, warps=1, stages=1)
    bm = 128 if s >= 512 * n_experts else 64
    bk = 32 if elt == 4 else 64
    return Plan(bm=bm, bn=64, bk=bk, bn_w=64, bk_w=64, br=bk, warps=8 if bm == 128 else 4, stages=3)


class Route(NamedTuple):
    perm: torch.Tensor  # [S] the pairs sorted by expert (int64)
    offsets: torch.Tensor  # [E + 1] each expert's first row in the sorted pairs (int64)
    tile_e: torch.Tensor  # [P] each row tile's expert (int32)
    tile_r0: torch.Tensor  # [P] its first row (int32); S for the surplus programs
    tiles: int  # P = cdiv(S, BM) + min(E, S): no expert has more than cdiv(its rows, BM) tiles


def route(top_k_index: torch.Tensor, n_experts: int, bm: int, op_id: str = sort.OP_ID) -> Route:
    """The pairs sorted by expert and the tile table of ``bm``-row tiles (``op_id``: the op the
    sort's index errors name)."""
    perm, offsets = sort.sort_by_expert(top_k_index, n_experts, op_id=op_id)
    s = perm.numel()
    rows = offsets[1:] - offsets[:-1]
    tiles = (rows + (bm - 1)) // bm
    last = torch.cumsum(tiles, 0)  # one past each expert's last tile
    p_max = _cdiv(s, bm) + min(n_experts, s)
    p = torch.arange(p_max, device=perm.device)
    e = torch.searchsorted(last, p, right=True)
    ec = e.clamp(max=n_experts - 1)
    r0 = offsets[ec] + (p - (last[ec] - tiles[ec])) * bm
    r0 = torch.where(e < n_experts, r0, s)  # past every expert's rows: the program does nothing
    return Route(perm, offsets, ec.to(torch.int32), r0.to(torch.int32), p_max)


class Problem(NamedTuple):
    """One call's sizes and launch facts, from ``start``."""

    t: int
    h: int
    k: int
    inter: int
    pl: Plan
    meta: dict[str, Any]


def _meta(pl: Plan, dtype: torch.dtype) -> dict[str, object]:
    """The launches' keywords: IEEE fp32 dot products (no TF32; ignored for 16-bit operands),
    bf16 operands upcast in the interpreter (see _dot), warps and stages."""
    upcast = dtype == torch.bfloat16 and env.triton_interpret()
    prec = "ieee" if dtype == torch.float32 else "tf32"
    return {"PREC": prec, "UPCAST": upcast, "num_warps": pl.warps, "num_stages": pl.stages}


def problem(hidden: torch.Tensor, top_k_index: torch.Tensor, n_experts: int, inter: int, pl: Plan | None = None) -> Problem:
    """The call's sizes, its plan (``pl``, or planned now) and launch keywords."""
    t, h = hidden.shape
    k = top_k_index.shape[1]
    if pl is None:
        pl = plan(t * k, n_experts, h, inter, hidden.element_size(), env.triton_interpret())
    return Problem(t, h, k, inter, pl, _meta(pl, hidden.dtype))


def rows_unit(t: torch.Tensor) -> torch.Tensor:
    """``t`` [R, C] with unit column stride (the kernels gather rows by pointer arithmetic)."""
    return t if t.stride(-1) == 1 or t.numel() == 0 else t.contiguous()


def empty(p: Problem, n: int, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An ``[S, n]`` buffer, one row per pair."""
    return torch.empty(p.t * p.k, n, dtype=dtype or like.dtype, device=like.device)


def sum_over_k(terms: torch.Tensor, p: Problem) -> torch.Tensor:
    """``[S, H]`` terms in token order -> ``[T, H]`` (k = 1: the terms are the result)."""
    return terms if p.k == 1 else terms.view(p.t, p.k, p.h).sum(1)


def scatter(
    a: torch.Tensor,
    b: torch.Tensor,
    b_strides: tuple[int, int, int],
    rt: Route,
    w_flat: torch.Tensor,
    weighted: bool,
    p: Problem,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``Σ_j (w ·) (a[r] @ b[e] (+ bias[e]))`` per token, ``a`` the sorted pairs' ``[S, K]``
    rows, ``b[e]`` ``[K, H]`` by ``b_strides`` (expert, K, H), ``bias`` ``[E, H]`` with unit
    column stride: the forward's down GEMM or the backward's dX."""
    terms = empty(p, p.h, a)
    launch(
        _scatter_kernel, (rt.tiles, _cdiv(p.h, p.pl.bn)),
        a, b, a if bias is None else bias, rt.perm, rt.tile_e, rt.tile_r0, rt.offsets, w_flat, terms,
        a.shape[1], p.h, a.stride(0), *b_strides, 0 if bias is None else bias.stride(0), terms.stride(0),
        HAS_BIAS=bias is not None, WEIGHTED=weighted, BM=p.pl.bm, BN=p.pl.bn, BK=p.pl.bk, **p.meta,
    )  # fmt: skip
    return sum_over_k(terms, p)


def expert_sums(a: torch.Tensor, b: torch.Tensor, rt: Route, out: torch.Tensor, a_gather: bool, b_gather: bool, p: Problem) -> torch.Tensor:
    """``out[e] = Σ_r a[ra]ᵀ ⊗ b[rb]`` over expert e's sorted rows r (``ra``/``rb``: r, or r's
    token where gathered; ``out`` [E, N, K] by its strides), through the dW kernel: one program
    per (expert, tile), rows in order, no atomics. Returns ``out``."""
    n_rows, n, kk = out.shape
    n_kb = _cdiv(kk, p.pl.bk_w)
    launch(
        _dw_kernel, (n_rows, _cdiv(n, p.pl.bn_w) * n_kb),
        a, b, rt.perm, rt.offsets, out,
        p.k, n, kk, n_kb, a.stride(0), b.stride(0), *out.stride(),
        A_GATHER=a_gather, B_GATHER=b_gather, BN=p.pl.bn_w, BK=p.pl.bk_w, BR=p.pl.br, **p.meta,
    )  # fmt: skip
    return out


def routing_weights_grad(part: torch.Tensor, top_k_weights: torch.Tensor, p: Problem) -> torch.Tensor:
    """d top_k_weights from the d-inner kernel's per-block partial sums (summed in a fixed order)."""
    return part.sum(1).view(p.t, p.k).to(top_k_weights.dtype)


def no_pair_grads(args: tuple[torch.Tensor, ...], needs: tuple[bool, ...]) -> tuple[torch.Tensor | None, ...]:
    """No pairs: every gradient is zero (none for the index, argument 1)."""
    return tuple(torch.zeros_like(a) if need and i != 1 else None for i, (a, need) in enumerate(zip(args, needs)))


# ---------------------------------------------------------------------------------------------
# autograd and the registered impl


class State(NamedTuple):
    """What the forward keeps for the backward: the route, the pre-activations, the plan."""

    rt: Route
    pre: torch.Tensor
    pl: Plan


class Layer(NamedTuple):
    """One op's Triton impl, for the shared autograd Function. ``forward(*args, *options, keep)``
    -> (out, State or None: no pairs); ``backward(dy, args, *options, state, needs)`` -> a
    gradient per tensor argument; ``reference(*args, *options)`` for double backward;
    ``fallback(*args, *options)`` under functorch transforms."""

    forward: Callable[..., tuple[torch.Tensor, State | None]]
    backward: Callable[..., tuple[torch.Tensor | None, ...]]
    reference: Callable[..., torch.Tensor]
    fallback: Callable[..., torch.Tensor]


class _GroupedExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, layer, options, *args):  # type: ignore[override]
        out, state = layer.forward(*args, *options, keep=True)
        kept = (state.rt.perm, state.rt.offsets, state.rt.tile_e, state.rt.tile_r0, state.pre) if state is not None else ()
        ctx.save_for_backward(*args, *kept)
        ctx.layer, ctx.options, ctx.n_args = layer, options, len(args)
        ctx.plan, ctx.tiles = (state.pl, state.rt.tiles) if state is not None else (None, 0)
        return out

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        saved = ctx.saved_tensors
        n = ctx.n_args
        args, kept = saved[:n], saved[n:]
        needs = tuple(ctx.needs_input_grad[2 : 2 + n])
        if torch.is_grad_enabled():  # create_graph=True: differentiable gradients, by the torch formula
            grads = graph_grads(ctx.layer.reference, (*args, *ctx.options), (dy,), (*needs, *(False,) * len(ctx.options)))
            return (None, None, *grads[:n])
        state = None
        if kept:
            perm, offsets, tile_e, tile_r0, pre = kept
            state = State(Route(perm, offsets, tile_e, tile_r0, ctx.tiles), pre, ctx.plan)
        return (None, None, *ctx.layer.backward(dy, args, *ctx.options, state, needs))


_apply = lean_apply(_GroupedExperts)


def experts(layer: Layer, args: tuple[torch.Tensor, ...], options: tuple[object, ...]) -> torch.Tensor:
    """The registered impl's body: ``args`` the tensors (the index second), ``options`` the rest."""
    if _transforms_active():  # functorch (vmap, grad): the kernels cannot read its wrapped tensors
        return layer.fallback(*args, *options)
    if torch.is_grad_enabled() and any(a.requires_grad for i, a in enumerate(args) if i != 1):
        return _apply(layer, options, *args)
    return layer.forward(*args, *options, keep=False)[0]
