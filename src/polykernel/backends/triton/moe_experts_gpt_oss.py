"""Triton gpt-oss MoE experts: :mod:`polykernel.backends.triton.moe_experts`' grouped GEMMs in gpt-oss's layout.

The same skeleton, sort and tile table (one sort per call, ``BM``-row tiles that never straddle
two experts, no atomics anywhere): gpt-oss's transposed weights are only other strides, the
interleaved gate/up another column map (gate = column 2n, up = 2n + 1), the biases adds in the
two forward epilogues, and the clamped SwiGLU (``(clamp(u, ±L) + 1)·g·σ(αg)``, ``g = min(gate,
L)``) the activation, with its derivative (zero past the limits, as torch's ``clamp``) in the
backward's epilogue. Kernels, in call order:

- ``_gate_up_kernel``: ``x[token] @ gate_up[e]`` for the gate and up columns of a block side by
  side, + bias, the activation in the epilogue: writes ``inner`` ``[S, I]`` and (training) the
  pre-activations ``[S, 2I]``, interleaved as the weight's columns;
- ``_down_kernel``: ``w·(inner @ down[e] + bias)``, each row stored at its pair's place in token
  order (the sum over a token's k pairs is then a contiguous reduction);
- ``_d_inner_kernel``: ``dy[token] @ down[e]ᵀ``; the epilogue recomputes the activation from the
  saved pre-activations and writes d(pre) interleaved (so dX and d gate_up are plain GEMMs with
  the weight's own column order), ``w·inner`` and the routing weights' gradient (partial sums);
- then the other module's ``_scatter_kernel`` (dX) and ``_dw_kernel`` (each expert's dW, and the
  biases' gradients as the same per-expert walk against a column of ones / the routing weights).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import env
from ...ops.moe_experts_gpt_oss import reference
from ..torch import moe_experts_gpt_oss as _torch_impl
from ..torch._double_backward import graph_grads
from ._autograd import lean_apply
from ._autograd import transforms_active as _transforms_active
from ._launch import launch
from ._rows import cdiv as _cdiv
from .moe_experts import Plan, _dot, _dw_kernel, _meta, _Route, _route, _row_tile, _rows_unit, _scatter_kernel, plan

# ---------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _gate_up_kernel(
    X, W, BIAS, PERM, TILE_E, TILE_R0, OFFS, INNER, PRE,
    K_TOP, H, N_I, stride_x, stride_we, stride_wh, stride_wn, stride_be, alpha, limit,
    STORE_PRE: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    e, r0, end, rows, rmask = _row_tile(TILE_E, TILE_R0, OFFS, BM)
    if r0 < end:
        tok = tl.load(PERM + rows, mask=rmask, other=0) // K_TOP
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        nmask = n < N_I
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        w_gate = W + e * stride_we + (2 * n)[None, :] * stride_wn
        w_up = w_gate + stride_wn
        for k0 in range(0, H, BK):
            kk = k0 + tl.arange(0, BK)
            kmask = kk < H
            x = tl.load(X + tok[:, None] * stride_x + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            wmask = kmask[:, None] & nmask[None, :]
            wg = tl.load(w_gate + kk[:, None] * stride_wh, mask=wmask, other=0.0)
            wu = tl.load(w_up + kk[:, None] * stride_wh, mask=wmask, other=0.0)
            acc_g = _dot(x, wg, acc_g, PREC, UPCAST)
            acc_u = _dot(x, wu, acc_u, PREC, UPCAST)
        b = BIAS + e * stride_be + 2 * n
        acc_g += tl.load(b, mask=nmask, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(b + 1, mask=nmask, other=0.0).to(tl.float32)[None, :]
        omask = rmask[:, None] & nmask[None, :]
        g = tl.minimum(acc_g, limit)
        u = tl.minimum(tl.maximum(acc_u, -limit), limit)
        inner = (u + 1.0) * (g * tl.sigmoid(alpha * g))
        tl.store(INNER + rows[:, None] * N_I + n[None, :], inner.to(INNER.dtype.element_ty), mask=omask)
        if STORE_PRE:
            pre = PRE + rows[:, None] * (2 * N_I) + (2 * n)[None, :]
            tl.store(pre, acc_g.to(PRE.dtype.element_ty), mask=omask)
            tl.store(pre + 1, acc_u.to(PRE.dtype.element_ty), mask=omask)


@triton.jit
def _down_kernel(
    A, B, BIAS, PERM, TILE_E, TILE_R0, OFFS, WFLAT, OUT,
    K, N, stride_a, stride_be, stride_bk, stride_bn, stride_biase, stride_out,
    PREC: tl.constexpr, UPCAST: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """OUT[perm[r]] = w[perm[r]] · (A[r] @ B[e] + BIAS[e]) for the sorted rows r of expert e."""
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
        acc += tl.load(BIAS + e * stride_biase + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
        acc = acc * tl.load(WFLAT + pair, mask=rmask, other=0.0).to(tl.float32)[:, None]
        tl.store(OUT + pair[:, None] * stride_out + n[None, :], acc.to(OUT.dtype.element_ty), mask=rmask[:, None] & nmask[None, :])


@triton.jit
def _d_inner_kernel(
    DY, B, BIAS, PRE, PERM, TILE_E, TILE_R0, OFFS, WFLAT, DPRE, HW, PART,
    K_TOP, H, N_I, n_blocks, stride_dy, stride_be, stride_bk, stride_bn, stride_biase, alpha, limit,
    PREC: tl.constexpr, UPCAST: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """d_inner = dy[token] @ down[e]ᵀ (unweighted), then the clamped SwiGLU's backward in the
    epilogue; the first column block also sums <dy, bias[e]> (the bias's part of d w)."""
    e, r0, end, rows, rmask = _row_tile(TILE_E, TILE_R0, OFFS, BM)
    if r0 < end:
        pair = tl.load(PERM + rows, mask=rmask, other=0)
        tok = pair // K_TOP
        pid_n = tl.program_id(1)
        n = pid_n * BN + tl.arange(0, BN)
        nmask = n < N_I
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        bias_dot = tl.zeros((BM,), dtype=tl.float32)
        b_base = B + e * stride_be + n[None, :] * stride_bn
        for k0 in range(0, H, BK):
            kk = k0 + tl.arange(0, BK)
            kmask = kk < H
            dy = tl.load(DY + tok[:, None] * stride_dy + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            b = tl.load(b_base + kk[:, None] * stride_bk, mask=kmask[:, None] & nmask[None, :], other=0.0)
            acc = _dot(dy, b, acc, PREC, UPCAST)
            bias = tl.load(BIAS + e * stride_biase + kk, mask=kmask, other=0.0).to(tl.float32)
            bias_dot += tl.sum(dy.to(tl.float32) * bias[None, :], axis=1)
        omask = rmask[:, None] & nmask[None, :]
        pre = PRE + rows[:, None] * (2 * N_I) + (2 * n)[None, :]
        gate = tl.load(pre, mask=omask, other=0.0).to(tl.float32)
        up = tl.load(pre + 1, mask=omask, other=0.0).to(tl.float32)
        g = tl.minimum(gate, limit)
        u = tl.minimum(tl.maximum(up, -limit), limit)
        sig = tl.sigmoid(alpha * g)
        glu = g * sig
        inner = (u + 1.0) * glu
        # torch's clamp passes the gradient where the value is inside the limits, ends included
        slope_g = tl.where(gate <= limit, (u + 1.0) * (sig + alpha * g * sig * (1.0 - sig)), 0.0)
        slope_u = tl.where((up >= -limit) & (up <= limit), glu, 0.0)
        tl.store(PART + pair * n_blocks + pid_n, tl.sum(acc * inner, axis=1) + tl.where(pid_n == 0, bias_dot, 0.0), mask=rmask)
        w = tl.load(WFLAT + pair, mask=rmask, other=0.0).to(tl.float32)[:, None]
        d_inner = acc * w
        dpre = DPRE + rows[:, None] * (2 * N_I) + (2 * n)[None, :]
        tl.store(dpre, (d_inner * slope_g).to(DPRE.dtype.element_ty), mask=omask)
        tl.store(dpre + 1, (d_inner * slope_u).to(DPRE.dtype.element_ty), mask=omask)
        tl.store(HW + rows[:, None] * N_I + n[None, :], (inner * w).to(HW.dtype.element_ty), mask=omask)


# ---------------------------------------------------------------------------------------------
# Host side


def forward(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    gate_up_proj_bias: torch.Tensor,
    down_proj: torch.Tensor,
    down_proj_bias: torch.Tensor,
    alpha: float,
    limit: float,
    keep: bool,
) -> tuple[torch.Tensor, tuple[_Route, torch.Tensor | None, Plan] | None]:
    """The output, and (when ``keep``) what the backward needs: the route, the pre-activations."""
    t, h = hidden.shape
    k = top_k_index.shape[1]
    n_experts, inter = gate_up_proj.shape[0], gate_up_proj.shape[2] // 2
    s = t * k
    if s == 0:
        return hidden.new_zeros(t, h), None
    pl = plan(s, n_experts, h, inter, hidden.element_size(), env.triton_interpret())
    rt = _route(top_k_index, n_experts, pl.bm)
    x = _rows_unit(hidden)
    w_flat = top_k_weights.reshape(-1).contiguous()
    b1, b2 = gate_up_proj_bias.contiguous(), down_proj_bias.contiguous()
    inner = torch.empty(s, inter, dtype=hidden.dtype, device=hidden.device)
    pre = torch.empty(s, 2 * inter, dtype=hidden.dtype, device=hidden.device) if keep else inner
    meta = _meta(pl, hidden.dtype)
    launch(
        _gate_up_kernel, (rt.tiles, _cdiv(inter, pl.bn)),
        x, gate_up_proj, b1, rt.perm, rt.tile_e, rt.tile_r0, rt.offsets, inner, pre,
        k, h, inter, x.stride(0), *gate_up_proj.stride(), b1.stride(0), float(alpha), float(limit),
        STORE_PRE=keep, BM=pl.bm, BN=pl.bn, BK=pl.bk, **meta,
    )  # fmt: skip
    terms = torch.empty(s, h, dtype=hidden.dtype, device=hidden.device)  # w·y per pair, in token order
    launch(
        _down_kernel, (rt.tiles, _cdiv(h, pl.bn)),
        inner, down_proj, b2, rt.perm, rt.tile_e, rt.tile_r0, rt.offsets, w_flat, terms,
        inter, h, inner.stride(0), *down_proj.stride(), b2.stride(0), terms.stride(0),
        BM=pl.bm, BN=pl.bn, BK=pl.bk, **meta,
    )  # fmt: skip
    out = terms if k == 1 else terms.view(t, k, h).sum(1)
    return out, ((rt, pre, pl) if keep else None)


def _expert_sums(
    a: torch.Tensor, b: torch.Tensor, rt: _Route, k: int, out: torch.Tensor, a_gather: bool, b_gather: bool, pl: Plan, meta: dict
) -> None:
    """``out[e] = Σ_r a[ra]ᵀ ⊗ b[rb]`` over expert e's sorted rows r (``ra``/``rb``: r, or r's
    token where gathered; ``out`` [E, N, K] by its strides), through the dW kernel: one program
    per (expert, tile), rows in order, no atomics."""
    n_rows, n, kk = out.shape
    n_kb = _cdiv(kk, pl.bk_w)
    launch(
        _dw_kernel, (n_rows, _cdiv(n, pl.bn_w) * n_kb),
        a, b, rt.perm, rt.offsets, out,
        k, n, kk, n_kb, a.stride(0), b.stride(0), *out.stride(),
        A_GATHER=a_gather, B_GATHER=b_gather, BN=pl.bn_w, BK=pl.bk_w, BR=pl.br, **meta,
    )  # fmt: skip


def backward(
    dy: torch.Tensor,
    args: tuple[torch.Tensor, ...],
    alpha: float,
    limit: float,
    state: tuple[_Route, torch.Tensor | None, Plan] | None,
    needs: tuple[bool, ...],
) -> tuple[torch.Tensor | None, ...]:
    """(d hidden, None, d top_k_weights, d gate_up_proj, d its bias, d down_proj, d its bias)."""
    hidden, top_k_index, top_k_weights, gate_up_proj, gate_up_proj_bias, down_proj, down_proj_bias = args
    if state is None:  # no pairs: every gradient is zero
        zeros = [None if i == 1 else torch.zeros_like(a) for i, a in enumerate(args)]
        return tuple(g if need else None for g, need in zip(zeros, needs))
    t, h = hidden.shape
    k = top_k_index.shape[1]
    inter = gate_up_proj.shape[2] // 2
    rt, pre, pl = state
    s = t * k
    dy = _rows_unit(dy)
    x = _rows_unit(hidden)
    w_flat = top_k_weights.reshape(-1).contiguous()
    b2 = down_proj_bias.contiguous()
    meta = _meta(pl, hidden.dtype)
    n_blocks = _cdiv(inter, pl.bn)
    d_pre = torch.empty(s, 2 * inter, dtype=hidden.dtype, device=hidden.device)
    hw = torch.empty(s, inter, dtype=hidden.dtype, device=hidden.device)
    part = torch.empty(s, n_blocks, dtype=torch.float32, device=hidden.device)
    launch(
        _d_inner_kernel, (rt.tiles, n_blocks),
        dy, down_proj, b2, pre, rt.perm, rt.tile_e, rt.tile_r0, rt.offsets, w_flat, d_pre, hw, part,
        k, h, inter, n_blocks, dy.stride(0), down_proj.stride(0), down_proj.stride(2), down_proj.stride(1), b2.stride(0),
        float(alpha), float(limit),
        BM=pl.bm, BN=pl.bn, BK=pl.bk, **meta,
    )  # fmt: skip
    grads: list[torch.Tensor | None] = [None] * 7
    if needs[2]:
        grads[2] = part.sum(1).view(t, k).to(top_k_weights.dtype)
    if needs[0]:  # dX = d_pre @ gate_up[e]ᵀ, d_pre in the weight's own (interleaved) column order
        terms = torch.empty(s, h, dtype=hidden.dtype, device=hidden.device)
        launch(
            _scatter_kernel, (rt.tiles, _cdiv(h, pl.bn)),
            d_pre, gate_up_proj, rt.perm, rt.tile_e, rt.tile_r0, rt.offsets, w_flat, terms,
            2 * inter, h, d_pre.stride(0), gate_up_proj.stride(0), gate_up_proj.stride(2), gate_up_proj.stride(1), terms.stride(0),
            WEIGHTED=False, BM=pl.bm, BN=pl.bn, BK=pl.bk, **meta,
        )  # fmt: skip
        grads[0] = terms if k == 1 else terms.view(t, k, h).sum(1)
    if needs[3]:  # d gate_up[e][h, j] = Σ x[token, h]·d_pre[r, j]: the [E, 2I, H] walk, stored transposed
        d_gate_up = torch.empty(gate_up_proj.shape, dtype=gate_up_proj.dtype, device=hidden.device)
        _expert_sums(x, d_pre, rt, k, d_gate_up, True, False, pl, meta)
        grads[3] = d_gate_up
    if needs[4]:
        ones = torch.ones(s, 1, dtype=hidden.dtype, device=hidden.device)
        d_b1 = torch.empty(gate_up_proj_bias.shape, dtype=gate_up_proj_bias.dtype, device=hidden.device)
        _expert_sums(ones, d_pre, rt, k, d_b1.unsqueeze(1), False, False, pl, meta)
        grads[4] = d_b1
    if needs[5]:  # d down[e][i, h] = Σ (w·inner)[r, i]·dy[token, h]
        d_down = torch.empty(down_proj.shape, dtype=down_proj.dtype, device=hidden.device)
        _expert_sums(hw, dy, rt, k, d_down, False, True, pl, meta)
        grads[5] = d_down
    if needs[6]:  # d bias[e][h] = Σ w[r]·dy[token, h]
        w_sorted = w_flat.index_select(0, rt.perm).to(hidden.dtype).unsqueeze(1)
        d_b2 = torch.empty(down_proj_bias.shape, dtype=down_proj_bias.dtype, device=hidden.device)
        _expert_sums(w_sorted, dy, rt, k, d_b2.unsqueeze(1), False, True, pl, meta)
        grads[6] = d_b2
    return tuple(grads)


class _MoEExpertsGptOss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, top_k_index, top_k_weights, gate_up_proj, gate_up_proj_bias, down_proj, down_proj_bias, alpha, limit):  # type: ignore[override]
        args = (hidden, top_k_index, top_k_weights, gate_up_proj, gate_up_proj_bias, down_proj, down_proj_bias)
        out, state = forward(*args, alpha, limit, keep=True)
        rt, pre, pl = state if state is not None else (None, None, None)
        kept = (rt.perm, rt.offsets, rt.tile_e, rt.tile_r0, pre) if rt is not None else ()
        ctx.save_for_backward(*args, *kept)
        ctx.alpha, ctx.limit, ctx.plan, ctx.tiles = alpha, limit, pl, (rt.tiles if rt is not None else 0)
        return out

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        saved = ctx.saved_tensors
        args, kept = saved[:7], saved[7:]
        needs = tuple(ctx.needs_input_grad[:7])
        if torch.is_grad_enabled():  # create_graph=True: differentiable gradients, by the torch formula
            return (*graph_grads(reference, (*args, ctx.alpha, ctx.limit), (dy,), (*needs, False, False)),)
        state = None
        if kept:
            perm, offsets, tile_e, tile_r0, pre = kept
            state = (_Route(perm, offsets, tile_e, tile_r0, ctx.tiles), pre, ctx.plan)
        return (*backward(dy, args, ctx.alpha, ctx.limit, state, needs), None, None)


_apply = lean_apply(_MoEExpertsGptOss)


def moe_experts_gpt_oss(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    gate_up_proj_bias: torch.Tensor,
    down_proj: torch.Tensor,
    down_proj_bias: torch.Tensor,
    alpha: float,
    limit: float,
) -> torch.Tensor:
    """The registered impl (arguments already validated by ``polykernel.moe_experts_gpt_oss``)."""
    args = (hidden, top_k_index, top_k_weights, gate_up_proj, gate_up_proj_bias, down_proj, down_proj_bias)
    if _transforms_active():  # functorch (vmap, grad): the kernels cannot read its wrapped tensors
        return _torch_impl.moe_experts_gpt_oss(*args, alpha, limit)
    trainable = (hidden, top_k_weights, gate_up_proj, gate_up_proj_bias, down_proj, down_proj_bias)
    if torch.is_grad_enabled() and any(a.requires_grad for a in trainable):
        return _apply(*args, alpha, limit)
    return forward(*args, alpha, limit, keep=False)[0]
