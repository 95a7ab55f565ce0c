"""Triton gpt-oss MoE experts: :mod:`polykernel.backends.triton._grouped`'s grouped GEMMs in gpt-oss's layout.

The same skeleton, sort, tile table and autograd plumbing as ``moe_experts`` (one sort per
call, ``BM``-row tiles that never straddle two experts, no atomics anywhere): gpt-oss's transposed
weights are only other strides, the interleaved gate/up another column map (gate = column 2n, up = 2n + 1), the biases adds in the
two forward epilogues, and the clamped SwiGLU (``(clamp(u, ±L) + 1)·g·σ(αg)``, ``g = min(gate,
L)``) the activation, with its derivative (zero past the limits, as torch's ``clamp``) in the
backward's epilogue. Kernels, in call order:

- ``_gate_up_kernel``: ``x[token] @ gate_up[e]`` for the gate and up columns of a block side by
  side, + bias, the activation in the epilogue: writes ``inner`` ``[S, I]`` and (training) the
  pre-activations ``[S, 2I]``, interleaved as the weight's columns;
- the shared ``_scatter_kernel`` with its bias: ``w·(inner @ down[e] + bias)``, each row stored at
  its pair's place in token order (the sum over a token's k pairs is then a contiguous reduction);
- ``_d_inner_kernel``: ``dy[token] @ down[e]ᵀ``; the epilogue recomputes the activation from the
  saved pre-activations and writes d(pre) interleaved (so dX and d gate_up are plain GEMMs with
  the weight's own column order), ``w·inner`` and the routing weights' gradient (partial sums);
- then ``_scatter_kernel`` again (dX) and ``_dw_kernel`` (each expert's dW, and the
  biases' gradients as the same per-expert walk against a column of ones / the routing weights).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...ops.moe_experts_gpt_oss import OP_ID, reference
from .._fallback import registered
from . import _grouped as grouped
from . import _grouped_mm as grouped_mm
from ._grouped import _clamped_swiglu, _clamped_swiglu_bwd, _gate_up_gemm, _row_gemm, _row_tile
from ._launch import launch
from ._rows import cdiv as _cdiv

# what this impl does not take goes to the torch impl, resolved by name on first use (polykernel.backends._fallback)
_torch_moe_experts_gpt_oss = registered("moe.moe_experts_gpt_oss")

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
        w_gate = W + e * stride_we + (2 * n)[None, :] * stride_wn  # interleaved: gate 2n, up 2n + 1
        w_up = w_gate + stride_wn
        acc_g, acc_u = _gate_up_gemm(X, tok, rmask, w_gate, w_up, H, stride_x, stride_wh, nmask, PREC, UPCAST, BM, BN, BK)
        b = BIAS + e * stride_be + 2 * n
        acc_g += tl.load(b, mask=nmask, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(b + 1, mask=nmask, other=0.0).to(tl.float32)[None, :]
        omask = rmask[:, None] & nmask[None, :]
        inner = _clamped_swiglu(acc_g, acc_u, alpha, limit)
        tl.store(INNER + rows[:, None] * N_I + n[None, :], inner.to(INNER.dtype.element_ty), mask=omask)
        if STORE_PRE:
            pre = PRE + rows[:, None] * (2 * N_I) + (2 * n)[None, :]
            tl.store(pre, acc_g.to(PRE.dtype.element_ty), mask=omask)
            tl.store(pre + 1, acc_u.to(PRE.dtype.element_ty), mask=omask)


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
        b_base = B + e * stride_be + n[None, :] * stride_bn
        bias = BIAS + e * stride_biase
        acc, bias_dot = _row_gemm(DY, tok, rmask, b_base, H, stride_dy, stride_bk, nmask, bias, True, PREC, UPCAST, BM, BN, BK)
        omask = rmask[:, None] & nmask[None, :]
        pre = PRE + rows[:, None] * (2 * N_I) + (2 * n)[None, :]
        gate = tl.load(pre, mask=omask, other=0.0).to(tl.float32)
        up = tl.load(pre + 1, mask=omask, other=0.0).to(tl.float32)
        inner, slope_g, slope_u = _clamped_swiglu_bwd(gate, up, alpha, limit)
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
) -> tuple[torch.Tensor, grouped.State | None]:
    """The output, and (when ``keep``) what the backward needs: the route, the pre-activations."""
    n_experts, inter = gate_up_proj.shape[0], gate_up_proj.shape[2] // 2
    p = grouped.problem(hidden, top_k_index, n_experts, inter)
    if p.t * p.k == 0:
        return hidden.new_zeros(p.t, p.h), None
    rt = grouped.route(top_k_index, n_experts, p.pl.bm, OP_ID)
    x = grouped.rows_unit(hidden)
    w_flat = top_k_weights.reshape(-1).contiguous()
    b1, b2 = gate_up_proj_bias.contiguous(), down_proj_bias.contiguous()
    inner = grouped.empty(p, inter, hidden)
    pre = grouped.empty(p, 2 * inter, hidden) if keep else inner
    launch(
        _gate_up_kernel, (rt.tiles, _cdiv(inter, p.pl.bn)),
        x, gate_up_proj, b1, rt.perm, rt.tile_e, rt.tile_r0, rt.offsets, inner, pre,
        p.k, p.h, inter, x.stride(0), *gate_up_proj.stride(), b1.stride(0), float(alpha), float(limit),
        STORE_PRE=keep, BM=p.pl.bm, BN=p.pl.bn, BK=p.pl.bk, **p.meta,
    )  # fmt: skip
    out = grouped.scatter(inner, down_proj, down_proj.stride(), rt, w_flat, True, p, bias=b2)  # w·(inner @ down[e] + bias[e])
    return out, (grouped.State(rt, pre, p.pl) if keep else None)


def backward(
    dy: torch.Tensor,
    args: tuple[torch.Tensor, ...],
    alpha: float,
    limit: float,
    state: grouped.State | None,
    needs: tuple[bool, ...],
) -> tuple[torch.Tensor | None, ...]:
    """(d hidden, None, d top_k_weights, d gate_up_proj, d its bias, d down_proj, d its bias)."""
    hidden, top_k_index, top_k_weights, gate_up_proj, gate_up_proj_bias, down_proj, down_proj_bias = args
    if state is None:  # no pairs: every gradient is zero
        return grouped.no_pair_grads(args, needs)
    rt, pre, pl = state
    inter = gate_up_proj.shape[2] // 2
    p = grouped.problem(hidden, top_k_index, gate_up_proj.shape[0], inter, pl)
    dy = grouped.rows_unit(dy)
    x = grouped.rows_unit(hidden)
    w_flat = top_k_weights.reshape(-1).contiguous()
    b2 = down_proj_bias.contiguous()
    n_blocks = _cdiv(inter, pl.bn)
    d_pre = grouped.empty(p, 2 * inter, hidden)
    hw = grouped.empty(p, inter, hidden)
    part = grouped.empty(p, n_blocks, hidden, torch.float32)
    launch(
        _d_inner_kernel, (rt.tiles, n_blocks),
        dy, down_proj, b2, pre, rt.perm, rt.tile_e, rt.tile_r0, rt.offsets, w_flat, d_pre, hw, part,
        p.k, p.h, inter, n_blocks, dy.stride(0), down_proj.stride(0), down_proj.stride(2), down_proj.stride(1), b2.stride(0),
        float(alpha), float(limit),
        BM=pl.bm, BN=pl.bn, BK=pl.bk, **p.meta,
    )  # fmt: skip
    grads: list[torch.Tensor | None] = [None] * 7
    if needs[2]:
        grads[2] = grouped.routing_weights_grad(part, top_k_weights, p)
    if needs[0]:  # dX = d_pre @ gate_up[e]ᵀ, d_pre in the weight's own (interleaved) column order
        gu_strides = (gate_up_proj.stride(0), gate_up_proj.stride(2), gate_up_proj.stride(1))
        grads[0] = grouped.scatter(d_pre, gate_up_proj, gu_strides, rt, w_flat, False, p)
    if needs[3]:  # d gate_up[e][h, j] = Σ x[token, h]·d_pre[r, j]: the [E, 2I, H] walk, stored transposed
        d_gate_up = torch.empty(gate_up_proj.shape, dtype=gate_up_proj.dtype, device=hidden.device)
        grads[3] = grouped.expert_sums(x, d_pre, rt, d_gate_up, True, False, p)
    if needs[4]:
        ones = torch.ones(p.t * p.k, 1, dtype=hidden.dtype, device=hidden.device)
        d_b1 = torch.empty(gate_up_proj_bias.shape, dtype=gate_up_proj_bias.dtype, device=hidden.device)
        grouped.expert_sums(ones, d_pre, rt, d_b1.unsqueeze(1), False, False, p)
        grads[4] = d_b1
    if needs[5]:  # d down[e][i, h] = Σ (w·inner)[r, i]·dy[token, h]
        d_down = torch.empty(down_proj.shape, dtype=down_proj.dtype, device=hidden.device)
        grads[5] = grouped.expert_sums(hw, dy, rt, d_down, False, True, p)
    if needs[6]:  # d bias[e][h] = Σ w[r]·dy[token, h]
        w_sorted = w_flat.index_select(0, rt.perm).to(hidden.dtype).unsqueeze(1)
        d_b2 = torch.empty(down_proj_bias.shape, dtype=down_proj_bias.dtype, device=hidden.device)
        grouped.expert_sums(w_sorted, dy, rt, d_b2.unsqueeze(1), False, True, p)
        grads[6] = d_b2
    return tuple(grads)


LAYER = grouped.Layer(forward, backward, reference, _torch_moe_experts_gpt_oss)
SPEC = grouped_mm.Spec(
    out_in=False,  # gate_up_proj [E, H, 2I], down_proj [E, I, H]
    interleaved=True,  # gate = columns 0, 2, 4 ..., up = 1, 3, 5 ...
    reference=lambda hidden, index, weights, gate_up, down, b1, b2, _act, alpha, limit: reference(
        hidden, index, weights, gate_up, b1, down, b2, alpha, limit
    ),
)


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
    if grouped_mm.takes(hidden, args, down_proj.shape[1], gate_up_proj, down_proj):
        ordered = (hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_proj_bias.contiguous(), down_proj_bias.contiguous())
        return grouped_mm.experts(SPEC, grouped_mm.CLAMPED, alpha, limit, OP_ID, ordered)
    return grouped.experts(LAYER, args, (alpha, limit))
