"""Triton MoE experts: grouped GEMMs over the token-expert pairs sorted by expert, forward and backward.

The pairs are sorted by expert once per call (:mod:`polykernel.backends.torch._moe_route`: no host
sync) and cut into tiles of ``BM`` rows that never straddle two experts; a tile table (expert and
first row per program, built with torch ops on the device) lets every row-GEMM launch a fixed
grid of ``cdiv(S, BM) + min(E, S)`` row tiles, the surplus programs doing nothing. The backward
reuses the sort and the table. Kernels, in call order (S = T·k pairs, each GEMM accumulates in
fp32 from operands of the inputs' dtype):

- ``_gate_up_kernel``: ``[S, H] x gate_up[e]ᵀ``, the gate and up halves side by side, the
  activation fused into the epilogue: writes ``act(g)·u`` ``[S, I]`` (and, when training, the
  pre-activations ``[S, 2I]`` for the backward), rows gathered from hidden by token;
- ``_scatter_kernel``: ``[S, K] x B[e]`` with the routing weight applied and each row stored at
  its pair's place in token order (the scatter back to tokens, fused), so the sum over a token's
  k pairs is a contiguous reduction (no atomics: the same bits every run). The forward's down
  projection and the backward's dX;
- ``_d_inner_kernel``: ``dy[token] x down[e]``, whose epilogue recomputes the activation from the
  saved pre-activations and writes d(gate, up) ``[S, 2I]``, ``w·act(g)·u`` ``[S, I]`` (for
  d down_proj) and the routing weights' gradient ``<down[e]ᵀ·dy, act(g)·u>`` as per-block
  partial sums over I (summed in a fixed order);
- ``_dw_kernel``: each expert's weight gradient ``Σ_pairs aᵀ ⊗ b`` over that expert's rows, one
  program per (expert, output tile) walking its rows in order: no atomics, deterministic.

Tile sizes are a host decision from the problem (:func:`plan`); the CPU interpreter gets small
ones. fp32 operands use IEEE dot products (no TF32: the op's fp32 error model is fp32's).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ... import env
from ...ops.moe_experts import reference
from ..torch import _moe_route as route
from ..torch import moe_experts as _torch_moe
from ..torch._double_backward import graph_grads
from ._autograd import lean_apply
from ._autograd import transforms_active as _transforms_active
from ._launch import launch
from ._rows import cdiv as _cdiv
from .glu import GELU_ERF, GELU_TANH, SILU, _act_fwd, _act_fwd_bwd

ACTS = {"silu": SILU, "gelu": GELU_ERF, "gelu_tanh": GELU_TANH}


# ---------------------------------------------------------------------------------------------
# Kernels


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
def _gate_up_kernel(
    X, W, PERM, TILE_E, TILE_R0, OFFS, INNER, PRE,
    K_TOP, H, N_I, stride_x, stride_we, stride_wn, stride_wh,
    ACT: tl.constexpr, STORE_PRE: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    e, r0, end, rows, rmask = _row_tile(TILE_E, TILE_R0, OFFS, BM)
    if r0 < end:
        tok = tl.load(PERM + rows, mask=rmask, other=0) // K_TOP
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        nmask = n < N_I
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        w_gate = W + e * stride_we + n[None, :] * stride_wn
        w_up = w_gate + N_I * stride_wn
        for k0 in range(0, H, BK):
            kk = k0 + tl.arange(0, BK)
            kmask = kk < H
            x = tl.load(X + tok[:, None] * stride_x + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            wmask = kmask[:, None] & nmask[None, :]
            wg = tl.load(w_gate + kk[:, None] * stride_wh, mask=wmask, other=0.0)
            wu = tl.load(w_up + kk[:, None] * stride_wh, mask=wmask, other=0.0)
            acc_g = _dot(x, wg, acc_g, PREC, UPCAST)
            acc_u = _dot(x, wu, acc_u, PREC, UPCAST)
        omask = rmask[:, None] & nmask[None, :]
        inner = _act_fwd(acc_g, ACT) * acc_u
        tl.store(INNER + rows[:, None] * N_I + n[None, :], inner.to(INNER.dtype.element_ty), mask=omask)
        if STORE_PRE:
            pre = PRE + rows[:, None] * (2 * N_I) + n[None, :]
            tl.store(pre, acc_g.to(PRE.dtype.element_ty), mask=omask)
            tl.store(pre + N_I, acc_u.to(PRE.dtype.element_ty), mask=omask)


@triton.jit
def _scatter_kernel(
    A, B, PERM, TILE_E, TILE_R0, OFFS, WFLAT, OUT,
    K, N, stride_a, stride_be, stride_bk, stride_bn, stride_out,
    WEIGHTED: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """OUT[perm[r]] = (w[perm[r]] ·) A[r] @ B[e] for the sorted rows r of expert e."""
    e, r0, end, rows, rmask = _row_tile(TILE_E, TILE_R0, OFFS, BM)
    if r0 < end:
        pair = tl.load(PERM + rows, mask=rmask, other=0)
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        nmask = n < N
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        b_base = B + e * stride_be + n[None, :] * stride_bn
        for k0 in range(0, K, BK):
            kk = k0 + tl.arange(0, BK)
            kmask = kk < K
            a = tl.load(A + rows[:, None] * stride_a + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            b = tl.load(b_base + kk[:, None] * stride_bk, mask=kmask[:, None] & nmask[None, :], other=0.0)
            acc = _dot(a, b, acc, PREC, UPCAST)
        if WEIGHTED:
            acc = acc * tl.load(WFLAT + pair, mask=rmask, other=0.0).to(tl.float32)[:, None]
        tl.store(OUT + pair[:, None] * stride_out + n[None, :], acc.to(OUT.dtype.element_ty), mask=rmask[:, None] & nmask[None, :])


@triton.jit
def _d_inner_kernel(
    DY, B, PRE, PERM, TILE_E, TILE_R0, OFFS, WFLAT, DPRE, HW, PART,
    K_TOP, H, N_I, n_blocks, stride_dy, stride_be, stride_bk, stride_bn,
    ACT: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """d_inner = dy[token] @ down[e] (unweighted), then the activation's backward in the epilogue."""
    e, r0, end, rows, rmask = _row_tile(TILE_E, TILE_R0, OFFS, BM)
    if r0 < end:
        pair = tl.load(PERM + rows, mask=rmask, other=0)
        tok = pair // K_TOP
        pid_n = tl.program_id(1)
        n = pid_n * BN + tl.arange(0, BN)
        nmask = n < N_I
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        b_base = B + e * stride_be + n[None, :] * stride_bn
        for k0 in range(0, H, BK):
            kk = k0 + tl.arange(0, BK)
            kmask = kk < H
            dy = tl.load(DY + tok[:, None] * stride_dy + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            b = tl.load(b_base + kk[:, None] * stride_bk, mask=kmask[:, None] & nmask[None, :], other=0.0)
            acc = _dot(dy, b, acc, PREC, UPCAST)
        omask = rmask[:, None] & nmask[None, :]
        pre = PRE + rows[:, None] * (2 * N_I) + n[None, :]
        g = tl.load(pre, mask=omask, other=0.0).to(tl.float32)
        u = tl.load(pre + N_I, mask=omask, other=0.0).to(tl.float32)
        a, slope = _act_fwd_bwd(g, ACT)
        inner = a * u
        # d w[pair] = <down[e]ᵀ·dy, act(g)·u>: this block's part of the sum over I
        tl.store(PART + pair * n_blocks + pid_n, tl.sum(acc * inner, axis=1), mask=rmask)
        w = tl.load(WFLAT + pair, mask=rmask, other=0.0).to(tl.float32)[:, None]
        d_inner = acc * w
        dpre = DPRE + rows[:, None] * (2 * N_I) + n[None, :]
        tl.store(dpre, (d_inner * u * slope).to(DPRE.dtype.element_ty), mask=omask)
        tl.store(dpre + N_I, (d_inner * a).to(DPRE.dtype.element_ty), mask=omask)
        tl.store(HW + rows[:, None] * N_I + n[None, :], (inner * w).to(HW.dtype.element_ty), mask=omask)


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
# Host side


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


class _Route(NamedTuple):
    perm: torch.Tensor  # [S] the pairs sorted by expert (int64)
    offsets: torch.Tensor  # [E + 1] each expert's first row in the sorted pairs (int64)
    tile_e: torch.Tensor  # [P] each row tile's expert (int32)
    tile_r0: torch.Tensor  # [P] its first row (int32); S for the surplus programs
    tiles: int  # P = cdiv(S, BM) + min(E, S): no expert has more than cdiv(its rows, BM) tiles


def _route(top_k_index: torch.Tensor, n_experts: int, bm: int) -> _Route:
    perm, offsets = route.sort_by_expert(top_k_index, n_experts)
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
    return _Route(perm, offsets, ec.to(torch.int32), r0.to(torch.int32), p_max)


def _meta(pl: Plan, dtype: torch.dtype) -> dict[str, object]:
    """The launches' keywords: IEEE fp32 dot products (no TF32; ignored for 16-bit operands),
    bf16 operands upcast in the interpreter (see _dot), warps and stages."""
    upcast = dtype == torch.bfloat16 and env.triton_interpret()
    prec = "ieee" if dtype == torch.float32 else "tf32"
    return {"PREC": prec, "UPCAST": upcast, "num_warps": pl.warps, "num_stages": pl.stages}


def _rows_unit(t: torch.Tensor) -> torch.Tensor:
    """``t`` [R, C] with unit column stride (the kernels gather rows by pointer arithmetic)."""
    return t if t.stride(-1) == 1 or t.numel() == 0 else t.contiguous()


def forward(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    activation: str,
    keep: bool,
) -> tuple[torch.Tensor, tuple[_Route, torch.Tensor | None, Plan] | None]:
    """The output, and (when ``keep``) what the backward needs: the route, the pre-activations."""
    t, h = hidden.shape
    k = top_k_index.shape[1]
    n_experts, inter = gate_up_proj.shape[0], gate_up_proj.shape[1] // 2
    s = t * k
    if s == 0:
        return hidden.new_zeros(t, h), None
    pl = plan(s, n_experts, h, inter, hidden.element_size(), env.triton_interpret())
    rt = _route(top_k_index, n_experts, pl.bm)
    x = _rows_unit(hidden)
    w_flat = top_k_weights.reshape(-1).contiguous()
    inner = torch.empty(s, inter, dtype=hidden.dtype, device=hidden.device)
    pre = torch.empty(s, 2 * inter, dtype=hidden.dtype, device=hidden.device) if keep else inner
    meta = _meta(pl, hidden.dtype)
    launch(
        _gate_up_kernel, (rt.tiles, _cdiv(inter, pl.bn)),
        x, gate_up_proj, rt.perm, rt.tile_e, rt.tile_r0, rt.offsets, inner, pre,
        k, h, inter, x.stride(0), *gate_up_proj.stride(),
        ACT=ACTS[activation], STORE_PRE=keep, BM=pl.bm, BN=pl.bn, BK=pl.bk, **meta,
    )  # fmt: skip
    terms = torch.empty(s, h, dtype=hidden.dtype, device=hidden.device)  # w·y per pair, in token order
    launch(
        _scatter_kernel, (rt.tiles, _cdiv(h, pl.bn)),
        inner, down_proj, rt.perm, rt.tile_e, rt.tile_r0, rt.offsets, w_flat, terms,
        inter, h, inner.stride(0), down_proj.stride(0), down_proj.stride(2), down_proj.stride(1), terms.stride(0),
        WEIGHTED=True, BM=pl.bm, BN=pl.bn, BK=pl.bk, **meta,
    )  # fmt: skip
    out = terms if k == 1 else terms.view(t, k, h).sum(1)  # (k = 1: the terms are the output)
    return out, ((rt, pre if keep else None, pl) if keep else None)


def backward(
    dy: torch.Tensor,
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    activation: str,
    state: tuple[_Route, torch.Tensor | None, Plan] | None,
    needs: tuple[bool, ...],
) -> tuple[torch.Tensor | None, ...]:
    """(d hidden, None, d top_k_weights, d gate_up_proj, d down_proj), None where not needed."""
    t, h = hidden.shape
    k = top_k_index.shape[1]
    n_experts, inter = gate_up_proj.shape[0], gate_up_proj.shape[1] // 2
    if state is None:  # no pairs: every gradient is zero
        zeros = (
            torch.zeros_like(hidden),
            None,
            torch.zeros_like(top_k_weights),
            torch.zeros_like(gate_up_proj),
            torch.zeros_like(down_proj),
        )
        return tuple(g if need else None for g, need in zip(zeros, needs))
    rt, pre, pl = state
    s = t * k
    dy = _rows_unit(dy)
    x = _rows_unit(hidden)
    w_flat = top_k_weights.reshape(-1).contiguous()
    meta = _meta(pl, hidden.dtype)
    n_blocks = _cdiv(inter, pl.bn)
    d_pre = torch.empty(s, 2 * inter, dtype=hidden.dtype, device=hidden.device)
    hw = torch.empty(s, inter, dtype=hidden.dtype, device=hidden.device)
    part = torch.empty(s, n_blocks, dtype=torch.float32, device=hidden.device)
    launch(
        _d_inner_kernel, (rt.tiles, n_blocks),
        dy, down_proj, pre, rt.perm, rt.tile_e, rt.tile_r0, rt.offsets, w_flat, d_pre, hw, part,
        k, h, inter, n_blocks, dy.stride(0), down_proj.stride(0), down_proj.stride(1), down_proj.stride(2),
        ACT=ACTS[activation], BM=pl.bm, BN=pl.bn, BK=pl.bk, **meta,
    )  # fmt: skip
    d_hidden = d_weights = d_gate_up = d_down = None
    if needs[2]:
        d_weights = part.sum(1).view(t, k).to(top_k_weights.dtype)
    if needs[0]:
        terms = torch.empty(s, h, dtype=hidden.dtype, device=hidden.device)
        launch(
            _scatter_kernel, (rt.tiles, _cdiv(h, pl.bn)),
            d_pre, gate_up_proj, rt.perm, rt.tile_e, rt.tile_r0, rt.offsets, w_flat, terms,
            2 * inter, h, d_pre.stride(0), gate_up_proj.stride(0), gate_up_proj.stride(1), gate_up_proj.stride(2), terms.stride(0),
            WEIGHTED=False, BM=pl.bm, BN=pl.bn, BK=pl.bk, **meta,
        )  # fmt: skip
        d_hidden = terms if k == 1 else terms.view(t, k, h).sum(1)
    if needs[3]:
        d_gate_up = torch.empty(gate_up_proj.shape, dtype=gate_up_proj.dtype, device=hidden.device)
        n_kb = _cdiv(h, pl.bk_w)
        launch(
            _dw_kernel, (n_experts, _cdiv(2 * inter, pl.bn_w) * n_kb),
            d_pre, x, rt.perm, rt.offsets, d_gate_up,
            k, 2 * inter, h, n_kb, d_pre.stride(0), x.stride(0), *d_gate_up.stride(),
            A_GATHER=False, B_GATHER=True, BN=pl.bn_w, BK=pl.bk_w, BR=pl.br, **meta,
        )  # fmt: skip
    if needs[4]:
        d_down = torch.empty(down_proj.shape, dtype=down_proj.dtype, device=hidden.device)
        n_kb = _cdiv(inter, pl.bk_w)
        launch(
            _dw_kernel, (n_experts, _cdiv(h, pl.bn_w) * n_kb),
            dy, hw, rt.perm, rt.offsets, d_down,
            k, h, inter, n_kb, dy.stride(0), hw.stride(0), *d_down.stride(),
            A_GATHER=True, B_GATHER=False, BN=pl.bn_w, BK=pl.bk_w, BR=pl.br, **meta,
        )  # fmt: skip
    return d_hidden, None, d_weights, d_gate_up, d_down


class _MoEExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, activation):  # type: ignore[override]
        out, state = forward(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, activation, keep=True)
        rt, pre, pl = state if state is not None else (None, None, None)
        kept = (rt.perm, rt.offsets, rt.tile_e, rt.tile_r0, pre) if rt is not None else ()
        ctx.save_for_backward(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, *kept)
        ctx.activation, ctx.plan, ctx.tiles = activation, pl, (rt.tiles if rt is not None else 0)
        return out

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        hidden, index, weights, gate_up, down, *kept = ctx.saved_tensors
        needs = tuple(ctx.needs_input_grad[:5])
        if torch.is_grad_enabled():  # create_graph=True: differentiable gradients, by the torch formula
            return (*graph_grads(reference, (hidden, index, weights, gate_up, down, ctx.activation), (dy,), (*needs, False)),)
        state = None
        if kept:
            perm, offsets, tile_e, tile_r0, pre = kept
            state = (_Route(perm, offsets, tile_e, tile_r0, ctx.tiles), pre, ctx.plan)
        return (*backward(dy, hidden, index, weights, gate_up, down, ctx.activation, state, needs), None)


_apply = lean_apply(_MoEExperts)


def moe_experts(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    activation: str,
) -> torch.Tensor:
    """The registered impl (arguments already validated by ``polykernel.moe_experts``)."""
    if _transforms_active():  # functorch (vmap, grad): the kernels cannot read its wrapped tensors
        return _torch_moe.moe_experts(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, activation)
    if torch.is_grad_enabled() and (
        hidden.requires_grad or top_k_weights.requires_grad or gate_up_proj.requires_grad or down_proj.requires_grad
    ):
        return _apply(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, activation)
    return forward(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, activation, keep=False)[0]
