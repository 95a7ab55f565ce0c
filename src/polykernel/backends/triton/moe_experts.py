"""Triton MoE experts: grouped GEMMs over the token-expert pairs sorted by expert, forward and backward.

The sort, the tile table, the shared kernels (``_scatter_kernel``, ``_dw_kernel``) and the
autograd plumbing are :mod:`polykernel.backends.triton._grouped`'s (one sort per call, ``BM``-row
tiles that never straddle two experts, no atomics anywhere). This op's kernels, in call order (S =
T·k pairs, each GEMM accumulates in fp32 from operands of the inputs' dtype):

- ``_gate_up_kernel``: ``[S, H] x gate_up[e]ᵀ``, the gate and up halves side by side, the
  activation fused into the epilogue: writes ``act(g)·u`` ``[S, I]`` (and, when training, the
  pre-activations ``[S, 2I]`` for the backward), rows gathered from hidden by token;
- ``_scatter_kernel`` (shared): ``[S, I] x down[e]ᵀ`` with the routing weight applied and each
  row stored at its pair's place in token order, so the sum over a token's k pairs is a
  contiguous reduction. The forward's down projection and the backward's dX;
- ``_d_inner_kernel``: ``dy[token] x down[e]``, whose epilogue recomputes the activation from the
  saved pre-activations and writes d(gate, up) ``[S, 2I]``, ``w·act(g)·u`` ``[S, I]`` (for
  d down_proj) and the routing weights' gradient ``<down[e]ᵀ·dy, act(g)·u>`` as per-block
  partial sums over I (summed in a fixed order);
- ``_dw_kernel`` (shared): each expert's weight gradient ``Σ_pairs aᵀ ⊗ b`` over that expert's
  rows, one program per (expert, output tile) walking its rows in order: deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...ops.moe_experts import reference
from .._fallback import registered
from . import _grouped as grouped
from . import _grouped_mm as grouped_mm
from ._grouped import Plan as Plan
from ._grouped import _gate_up_gemm, _row_gemm, _row_tile
from ._grouped import plan as plan
from ._launch import launch
from ._rows import cdiv as _cdiv
from .glu import GELU_ERF, GELU_TANH, SILU, _act_fwd, _act_fwd_bwd

# what this impl does not take goes to the torch impl, resolved by name on first use (polykernel.backends._fallback)
_torch_moe_experts = registered("moe.moe_experts")

ACTS = {"silu": SILU, "gelu": GELU_ERF, "gelu_tanh": GELU_TANH}


# ---------------------------------------------------------------------------------------------
# Kernels


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
        w_gate = W + e * stride_we + n[None, :] * stride_wn  # the gate half's rows, then the up half's
        w_up = w_gate + N_I * stride_wn
        acc_g, acc_u = _gate_up_gemm(X, tok, rmask, w_gate, w_up, H, stride_x, stride_wh, nmask, PREC, UPCAST, BM, BN, BK)
        omask = rmask[:, None] & nmask[None, :]
        inner = _act_fwd(acc_g, ACT) * acc_u
        tl.store(INNER + rows[:, None] * N_I + n[None, :], inner.to(INNER.dtype.element_ty), mask=omask)
        if STORE_PRE:
            pre = PRE + rows[:, None] * (2 * N_I) + n[None, :]
            tl.store(pre, acc_g.to(PRE.dtype.element_ty), mask=omask)
            tl.store(pre + N_I, acc_u.to(PRE.dtype.element_ty), mask=omask)


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
        b_base = B + e * stride_be + n[None, :] * stride_bn
        acc, _ = _row_gemm(DY, tok, rmask, b_base, H, stride_dy, stride_bk, nmask, DY, False, PREC, UPCAST, BM, BN, BK)
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


# ---------------------------------------------------------------------------------------------
# Host side


def forward(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    activation: str,
    keep: bool,
) -> tuple[torch.Tensor, grouped.State | None]:
    """The output, and (when ``keep``) what the backward needs: the route, the pre-activations."""
    n_experts, inter = gate_up_proj.shape[0], gate_up_proj.shape[1] // 2
    p = grouped.problem(hidden, top_k_index, n_experts, inter)
    if p.t * p.k == 0:
        return hidden.new_zeros(p.t, p.h), None
    rt = grouped.route(top_k_index, n_experts, p.pl.bm)
    x = grouped.rows_unit(hidden)
    w_flat = top_k_weights.reshape(-1).contiguous()
    inner = grouped.empty(p, inter, hidden)
    pre = grouped.empty(p, 2 * inter, hidden) if keep else inner
    launch(
        _gate_up_kernel, (rt.tiles, _cdiv(inter, p.pl.bn)),
        x, gate_up_proj, rt.perm, rt.tile_e, rt.tile_r0, rt.offsets, inner, pre,
        p.k, p.h, inter, x.stride(0), *gate_up_proj.stride(),
        ACT=ACTS[activation], STORE_PRE=keep, BM=p.pl.bm, BN=p.pl.bn, BK=p.pl.bk, **p.meta,
    )  # fmt: skip
    d_strides = (down_proj.stride(0), down_proj.stride(2), down_proj.stride(1))  # down[e]ᵀ: [I, H]
    out = grouped.scatter(inner, down_proj, d_strides, rt, w_flat, True, p)
    return out, (grouped.State(rt, pre, p.pl) if keep else None)


def backward(
    dy: torch.Tensor,
    args: tuple[torch.Tensor, ...],
    activation: str,
    state: grouped.State | None,
    needs: tuple[bool, ...],
) -> tuple[torch.Tensor | None, ...]:
    """(d hidden, None, d top_k_weights, d gate_up_proj, d down_proj), None where not needed."""
    hidden, top_k_index, top_k_weights, gate_up_proj, down_proj = args
    if state is None:  # no pairs: every gradient is zero
        return grouped.no_pair_grads(args, needs)
    rt, pre, pl = state
    inter = gate_up_proj.shape[1] // 2
    p = grouped.problem(hidden, top_k_index, gate_up_proj.shape[0], inter, pl)
    dy = grouped.rows_unit(dy)
    x = grouped.rows_unit(hidden)
    w_flat = top_k_weights.reshape(-1).contiguous()
    n_blocks = _cdiv(inter, pl.bn)
    d_pre = grouped.empty(p, 2 * inter, hidden)
    hw = grouped.empty(p, inter, hidden)
    part = grouped.empty(p, n_blocks, hidden, torch.float32)
    launch(
        _d_inner_kernel, (rt.tiles, n_blocks),
        dy, down_proj, pre, rt.perm, rt.tile_e, rt.tile_r0, rt.offsets, w_flat, d_pre, hw, part,
        p.k, p.h, inter, n_blocks, dy.stride(0), down_proj.stride(0), down_proj.stride(1), down_proj.stride(2),
        ACT=ACTS[activation], BM=pl.bm, BN=pl.bn, BK=pl.bk, **p.meta,
    )  # fmt: skip
    d_hidden = d_weights = d_gate_up = d_down = None
    if needs[2]:
        d_weights = grouped.routing_weights_grad(part, top_k_weights, p)
    if needs[0]:
        d_hidden = grouped.scatter(d_pre, gate_up_proj, gate_up_proj.stride(), rt, w_flat, False, p)
    if needs[3]:
        d_gate_up = torch.empty(gate_up_proj.shape, dtype=gate_up_proj.dtype, device=hidden.device)
        grouped.expert_sums(d_pre, x, rt, d_gate_up, False, True, p)
    if needs[4]:
        d_down = torch.empty(down_proj.shape, dtype=down_proj.dtype, device=hidden.device)
        grouped.expert_sums(dy, hw, rt, d_down, True, False, p)
    return d_hidden, None, d_weights, d_gate_up, d_down


LAYER = grouped.Layer(forward, backward, reference, _torch_moe_experts)
_ACT_NAMES = {code: name for name, code in ACTS.items()}
SPEC = grouped_mm.Spec(
    out_in=True,  # gate_up_proj [E, 2I, H], down_proj [E, H, I]
    interleaved=False,  # gate rows first, then up
    reference=lambda hidden, index, weights, gate_up, down, _b1, _b2, act, _alpha, _limit: reference(
        hidden, index, weights, gate_up, down, _ACT_NAMES[act]
    ),
)


def moe_experts(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    activation: str,
) -> torch.Tensor:
    """The registered impl (arguments already validated by ``polykernel.moe_experts``): the GEMMs
    through ``torch._grouped_mm`` where it runs for this call (see :mod:`._grouped_mm`), else ours."""
    args = (hidden, top_k_index, top_k_weights, gate_up_proj, down_proj)
    if grouped_mm.takes(hidden, args, down_proj.shape[2], gate_up_proj, down_proj):
        return grouped_mm.experts(SPEC, ACTS[activation], 0.0, 0.0, "moe.moe_experts", (*args, None, None))
    return grouped.experts(LAYER, args, (activation,))
