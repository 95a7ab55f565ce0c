"""MoE experts on ``torch._grouped_mm`` (CUTLASS grouped GEMMs on sm_90) with Triton kernels for
everything around the GEMMs: both MoE ops' Triton impls take this path where the call's GEMMs can
use ``torch._grouped_mm`` (a 16-bit dtype on a GPU, the projections contiguous and 16-byte
aligned, not in deterministic mode, probed once per device and dtype), and their own grouped
GEMMs (:mod:`._grouped`) elsewhere. Why: on the H200 our Triton GEMMs reached 27.6% of the GEMM
rate at Mixtral's shape where CUTLASS's reach about 60% (issue 33; the figures of this path
are in ``benchmarks/results/h200-2026-12-03-moe/``).

S = T·k token-expert pairs, sorted by expert once (no host sync). Forward::

    x_s   = hidden[token of each sorted pair]                   gather, [S, H]
    gu    = grouped_mm(x_s, gate_up)                            [S, 2I], the dtype
    inner = act(gu (+ gate_up bias[e]))                         _act_fwd_kernel, [S, I]
    y     = grouped_mm(inner, down)                             [S, H]
    out[t] = Σ_j w[t, j]·(y[pair] (+ down bias[e]))             _combine_kernel, fp32, one rounding

It keeps one ``[S, 2I]`` buffer for the backward (``gu``; the gather is redone), where autograd
through transformers' grouped_mm path keeps the gather, ``gu``, the activation and the expert
outputs. Backward::

    dy_s  = dy[token]                                           gather
    dI    = grouped_mm(dy_s, downᵀ)                             [S, I]
    _act_bwd_kernel: d_gu [S, 2I]; w·inner written over dI; d w per pair (its sum over I)
    dX    = Σ_j grouped_mm(d_gu, gate_upᵀ)[pair]                _combine_kernel, unweighted
    d gate_up[e] = d_gu[rows of e]ᵀ·x_s[rows of e];  d down[e] = dy_s[rows of e]ᵀ·(w·inner)
    biases: sums over each expert's rows, in row order          _segment_sum_kernel

Weights come in either stored layout: ``[E, out, in]`` (transformers', ``moe_experts``) or
``[E, in, out]`` (gpt-oss's); gate/up as two halves or interleaved columns (:class:`Spec`).
No atomics anywhere; CUDA-graph safe (the group offsets stay on the device).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ... import _compat
from .. import _moe_experts as _moe
from .. import _moe_route as sort
from .._double_backward import graph_grads
from ._autograd import lean_apply
from ._autograd import transforms_active as _transforms_active
from ._grouped import _clamped_swiglu, _clamped_swiglu_bwd
from ._launch import launch
from ._rows import cdiv as _cdiv
from .glu import _act_fwd, _act_fwd_bwd

CLAMPED = 3  # gpt-oss's clamped SwiGLU; 0-2 are glu.py's SILU, GELU_TANH, GELU_ERF

# ---------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _gate_up(GU, BIAS, row, e, cols, cmask, N_I, stride_gu, stride_be, INTERLEAVED: tl.constexpr, HAS_BIAS: tl.constexpr):
    """One row's gate and up pre-activations at ``cols`` in fp32 (+ the expert's bias), and the
    columns they sit at in the ``[S, 2I]`` layout."""
    if INTERLEAVED:
        gc = 2 * cols
        uc = gc + 1
    else:
        gc = cols
        uc = cols + N_I
    g = tl.load(GU + row * stride_gu + gc, mask=cmask, other=0.0).to(tl.float32)
    u = tl.load(GU + row * stride_gu + uc, mask=cmask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        g += tl.load(BIAS + e * stride_be + gc, mask=cmask, other=0.0).to(tl.float32)
        u += tl.load(BIAS + e * stride_be + uc, mask=cmask, other=0.0).to(tl.float32)
    return g, u, gc, uc


@triton.jit
def _act_fwd_kernel(
    GU, BIAS, EXPERT, INNER,
    N_I, stride_gu, stride_in, stride_be, alpha, limit,
    ACT: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """INNER[r] = act(gate)·up (gpt-oss: (clamp(up) + 1)·g·σ(alpha·g), g = min(gate, limit))."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cmask = cols < N_I
    e = 0
    if HAS_BIAS:
        e = tl.load(EXPERT + row).to(tl.int64)
    g, u, _, _ = _gate_up(GU, BIAS, row, e, cols, cmask, N_I, stride_gu, stride_be, INTERLEAVED, HAS_BIAS)
    if ACT == 3:
        inner = _clamped_swiglu(g, u, alpha, limit)
    else:
        inner = _act_fwd(g, ACT) * u
    tl.store(INNER + row * stride_in + cols, inner.to(INNER.dtype.element_ty), mask=cmask)


@triton.jit
def _act_bwd_kernel(
    GU, BIAS, EXPERT, DI, WS, PERM, DGU, DW, DYS, BIAS_D,
    N_I, H, stride_gu, stride_di, stride_dgu, stride_be, stride_dys, stride_bde, alpha, limit,
    ACT: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_BIAS_D: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """One sorted row: d(gate, up) into DGU, w·inner over DI (in place: each element is read
    before it is written, by the same program), and d w[pair] = <dI, inner> (+ <dy, down bias[e]>)."""
    row = tl.program_id(0).to(tl.int64)
    w = tl.load(WS + row).to(tl.float32)
    e = 0
    if HAS_BIAS or HAS_BIAS_D:
        e = tl.load(EXPERT + row).to(tl.int64)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for c0 in range(0, N_I, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        cmask = cols < N_I
        g, u, gcol, ucol = _gate_up(GU, BIAS, row, e, cols, cmask, N_I, stride_gu, stride_be, INTERLEAVED, HAS_BIAS)
        di = tl.load(DI + row * stride_di + cols, mask=cmask, other=0.0).to(tl.float32)
        if ACT == 3:
            inner, slope_g, slope_u = _clamped_swiglu_bwd(g, u, alpha, limit)
        else:
            a, d = _act_fwd_bwd(g, ACT)
            inner = a * u
            slope_g = u * d
            slope_u = a
        acc += di * inner
        d_inner = di * w
        tl.store(DGU + row * stride_dgu + gcol, (d_inner * slope_g).to(DGU.dtype.element_ty), mask=cmask)
        tl.store(DGU + row * stride_dgu + ucol, (d_inner * slope_u).to(DGU.dtype.element_ty), mask=cmask)
        tl.store(DI + row * stride_di + cols, (inner * w).to(DI.dtype.element_ty), mask=cmask)
    dw = tl.sum(acc, axis=0)
    if HAS_BIAS_D:  # the down bias's part of d w: <dy[token], bias[e]>
        bacc = tl.zeros((BLOCK,), dtype=tl.float32)
        for h0 in range(0, H, BLOCK):
            hh = h0 + tl.arange(0, BLOCK)
            hmask = hh < H
            dy = tl.load(DYS + row * stride_dys + hh, mask=hmask, other=0.0).to(tl.float32)
            bd = tl.load(BIAS_D + e * stride_bde + hh, mask=hmask, other=0.0).to(tl.float32)
            bacc += dy * bd
        dw += tl.sum(bacc, axis=0)
    tl.store(DW + tl.load(PERM + row), dw)


@triton.jit
def _combine_kernel(
    Y, INV, W, BIAS, EXPERT, OUT,
    K_TOP, H, stride_y, stride_o, stride_be,
    WEIGHTED: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """OUT[t] = Σ_j (w[t, j]·)(Y[sorted row of pair (t, j)] (+ BIAS[its expert])), in fp32, j in order."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cmask = cols < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in range(0, K_TOP):
        pair = t * K_TOP + j
        r = tl.load(INV + pair)
        v = tl.load(Y + r * stride_y + cols, mask=cmask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            e = tl.load(EXPERT + r).to(tl.int64)
            v += tl.load(BIAS + e * stride_be + cols, mask=cmask, other=0.0).to(tl.float32)
        if WEIGHTED:
            v = v * tl.load(W + pair).to(tl.float32)
        acc += v
    tl.store(OUT + t * stride_o + cols, acc.to(OUT.dtype.element_ty), mask=cmask)


@triton.jit
def _segment_sum_kernel(
    A, SCALE, OFFS, OUT, N, stride_a, stride_o,
    SCALED: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    """OUT[e] = Σ_r (SCALE[r]·) A[r] over expert e's sorted rows, in row order, in fp32."""
    e = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    cmask = cols < N
    start = tl.load(OFFS + e).to(tl.int64)
    end = tl.load(OFFS + e + 1).to(tl.int64)
    acc = tl.zeros((BN,), dtype=tl.float32)
    for r0 in range(start, end, BR):
        r = r0 + tl.arange(0, BR)
        rmask = r < end
        a = tl.load(A + r[:, None] * stride_a + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        if SCALED:
            a = a * tl.load(SCALE + r, mask=rmask, other=0.0).to(tl.float32)[:, None]
        acc += tl.sum(a, axis=0)
    tl.store(OUT + e * stride_o + cols, acc.to(OUT.dtype.element_ty), mask=cmask)


# ---------------------------------------------------------------------------------------------
# Host side


class Spec(NamedTuple):
    """One op's facts for this path. ``out_in``: weights stored ``[E, out, in]`` (transformers')
    rather than ``[E, in, out]`` (gpt-oss's); ``interleaved``: gate/up columns interleaved
    rather than two halves; ``reference(hidden, index, weights, gate_up, down, gate_up_bias,
    down_bias, act, alpha, limit)`` (``act``: glu.py's code or :data:`CLAMPED`) for double
    backward."""

    out_in: bool
    interleaved: bool
    reference: Callable[..., torch.Tensor]


# "auto": this path wherever it runs on a GPU; "kernels": never (our grouped GEMMs); "grouped_mm":
# wherever torch._grouped_mm runs, the CPU too (the tests cover this path there, through
# Triton's interpreter). Tests set it; users choose between impls, not paths.
MODE = "auto"


def takes(hidden: torch.Tensor, tensors: tuple[torch.Tensor, ...], inter: int, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether this call runs here (else the impl's own grouped GEMMs)."""
    if MODE == "kernels" or _transforms_active() or not _moe.plain(tensors):
        return False
    if MODE == "auto" and not (hidden.is_cuda and hidden.dtype in (torch.bfloat16, torch.float16)):
        return False
    if hidden.shape[0] == 0:
        return False
    return _moe.refusal(hidden, inter, gate_up, down) is None


def _mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return _compat.grouped_mm(a, b, offs=offs)


def _fwd(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, out_in: bool) -> torch.Tensor:
    """``a[rows of e] @ W_e`` (in -> out) per expert."""
    return _mm(a, w.mT if out_in else w, offs)


def _bwd(g: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, out_in: bool) -> torch.Tensor:
    """``g[rows of e] @ W_eᵀ`` (out -> in): the data gradient."""
    return _mm(g, w if out_in else w.mT, offs)


def _wgrad(g: torch.Tensor, a: torch.Tensor, offs: torch.Tensor, out_in: bool) -> torch.Tensor:
    """Each expert's weight gradient over its rows, in the stored layout (groups along the K
    dimension of a 2-d x 2-d grouped GEMM)."""
    return _mm(g.mT, a, offs) if out_in else _mm(a.mT, g, offs)


def _block(n: int) -> int:
    return max(16, min(2048, triton.next_power_of_2(n)))


class Route(NamedTuple):
    perm: torch.Tensor  # [S] pairs sorted by expert
    offsets: torch.Tensor  # [E + 1] int64
    offs: torch.Tensor  # [E] int32: each group's end, for grouped_mm
    inv: torch.Tensor  # [S] each pair's sorted row
    token: torch.Tensor  # [S] each sorted row's token
    expert: torch.Tensor | None  # [S] each sorted row's expert (for the biases)


def _route(index: torch.Tensor, n_experts: int, op_id: str, with_expert: bool) -> Route:
    perm, offsets = sort.sort_by_expert(index, n_experts, op_id=op_id)
    expert = index.reshape(-1).index_select(0, perm) if with_expert else None
    return Route(perm, offsets, offsets[1:].to(torch.int32), sort.inverse(perm), perm // index.shape[1], expert)


def _combine(
    y: torch.Tensor, rt: Route, t: int, k: int, w_flat: torch.Tensor | None, bias: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    h = y.shape[1]
    out = torch.empty(t, h, dtype=dtype, device=y.device)
    block = min(1024, _block(h))
    launch(
        _combine_kernel, (t, _cdiv(h, block)),
        y, rt.inv, y if w_flat is None else w_flat, y if bias is None else bias, y if rt.expert is None else rt.expert, out,
        k, h, y.stride(0), out.stride(0), 0 if bias is None else bias.stride(0),
        WEIGHTED=w_flat is not None, HAS_BIAS=bias is not None, BLOCK=block, num_warps=4,
    )  # fmt: skip
    return out


def _segment_sum(a: torch.Tensor, rt: Route, n_experts: int, like: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    n = a.shape[1]
    out = torch.empty(n_experts, n, dtype=like.dtype, device=a.device)
    launch(
        _segment_sum_kernel, (n_experts, _cdiv(n, 128)),
        a, a if scale is None else scale, rt.offsets, out, n, a.stride(0), out.stride(0),
        SCALED=scale is not None, BR=32, BN=128, num_warps=4,
    )  # fmt: skip
    return out


def forward(
    spec: Spec, act: int, alpha: float, limit: float, args: tuple[torch.Tensor | None, ...], op_id: str, keep: bool
) -> tuple[torch.Tensor, tuple[Route, torch.Tensor] | None]:
    """``args`` = (hidden, index, weights, gate_up, down, gate_up_bias, down_bias) (biases may be
    None). The output, and (when ``keep``) the route and ``gu`` for the backward."""
    hidden, index, weights, gate_up, down, b_gu, b_d = args
    t, k = index.shape
    inter = down.shape[2] if spec.out_in else down.shape[1]
    rt = _route(index, gate_up.shape[0], op_id, b_gu is not None or b_d is not None)
    x_s = hidden.index_select(0, rt.token)
    gu = _fwd(x_s, gate_up, rt.offs, spec.out_in)
    del x_s
    inner = torch.empty(gu.shape[0], inter, dtype=hidden.dtype, device=hidden.device)
    block = _block(inter)
    launch(
        _act_fwd_kernel, (gu.shape[0], _cdiv(inter, block)),
        gu, gu if b_gu is None else b_gu, gu if rt.expert is None else rt.expert, inner,
        inter, gu.stride(0), inner.stride(0), 0 if b_gu is None else b_gu.stride(0), float(alpha), float(limit),
        ACT=act, INTERLEAVED=spec.interleaved, HAS_BIAS=b_gu is not None, BLOCK=block, num_warps=4,
    )  # fmt: skip
    y = _fwd(inner, down, rt.offs, spec.out_in)
    del inner
    w_flat = weights.reshape(-1)
    out = _combine(y, rt, t, k, w_flat, b_d, hidden.dtype)
    return out, ((rt, gu) if keep else None)


def backward(
    spec: Spec,
    act: int,
    alpha: float,
    limit: float,
    dy: torch.Tensor,
    args: tuple[torch.Tensor | None, ...],
    rt: Route,
    gu: torch.Tensor,
    needs: tuple[bool, ...],
) -> list[torch.Tensor | None]:
    """A gradient per entry of ``args`` (None where not needed; none for the index). ``gu`` is
    overwritten with its gradient: at the peak (both weight gradients alive) one ``[S, 2I]``
    buffer instead of two, which is what keeps the layer at or under grouped_mm's peak
    (benchmarks/results/h200-2026-12-03-moe/moe_mixtral_after_reorder.jsonl: 4737 MiB with a
    separate gradient buffer against grouped_mm's 3904)."""
    hidden, index, weights, gate_up, down, b_gu, b_d = args
    t, k = index.shape
    n_experts = gate_up.shape[0]
    inter = down.shape[2] if spec.out_in else down.shape[1]
    s = gu.shape[0]
    grads: list[torch.Tensor | None] = [None] * 7
    dy_s = dy.index_select(0, rt.token)
    d_inner = _bwd(dy_s, down, rt.offs, spec.out_in)  # [S, I], unweighted
    w_s = weights.reshape(-1).index_select(0, rt.perm)
    d_gu = gu  # written over gu, element by element after reading it: gu is dead after this kernel
    dw = torch.empty(s, dtype=torch.float32, device=dy.device)
    launch(
        _act_bwd_kernel, (s,),
        gu, gu if b_gu is None else b_gu, gu if rt.expert is None else rt.expert, d_inner, w_s, rt.perm, d_gu, dw,
        dy_s, dy_s if b_d is None else b_d,
        inter, dy_s.shape[1], gu.stride(0), d_inner.stride(0), d_gu.stride(0), 0 if b_gu is None else b_gu.stride(0),
        dy_s.stride(0), 0 if b_d is None else b_d.stride(0), float(alpha), float(limit),
        ACT=act, INTERLEAVED=spec.interleaved, HAS_BIAS=b_gu is not None, HAS_BIAS_D=b_d is not None and needs[2],
        BLOCK=min(1024, _block(inter)), num_warps=4,
    )  # fmt: skip
    hw = d_inner  # now w·inner
    del d_inner
    if needs[2]:
        grads[2] = dw.view(t, k).to(weights.dtype)
    # Order for the peak: what reads dy_s and w·inner first, then free them; d_gu last.
    if needs[4]:
        grads[4] = _wgrad(dy_s, hw, rt.offs, spec.out_in)
    del hw
    if b_d is not None and needs[6]:
        grads[6] = _segment_sum(dy_s, rt, n_experts, b_d, w_s)
    del dy_s
    if needs[0]:
        grads[0] = _combine(_bwd(d_gu, gate_up, rt.offs, spec.out_in), rt, t, k, None, None, hidden.dtype)
    if b_gu is not None and needs[5]:
        grads[5] = _segment_sum(d_gu, rt, n_experts, b_gu)
    if needs[3]:
        grads[3] = _wgrad(d_gu, hidden.index_select(0, rt.token), rt.offs, spec.out_in)
    return grads


def _gate_up_again(spec: Spec, args: tuple[torch.Tensor | None, ...], rt: Route) -> torch.Tensor:
    """The forward's ``gu`` (pre-activation, without the gate/up bias), recomputed."""
    hidden, gate_up = args[0], args[3]
    return _fwd(hidden.index_select(0, rt.token), gate_up, rt.offs, spec.out_in)


class _Experts(torch.autograd.Function):
    # The backward writes the gradient of ``gu`` over the saved ``gu`` (see :func:`backward`). A
    # second backward through the same graph (``retain_graph=True``) finds it overwritten and
    # recomputes it from the saved inputs (one grouped GEMM), so it stays exact; ``ctx.spent``
    # says so. torch cannot tell a backward whether the graph will be kept.
    @staticmethod
    def forward(ctx, spec, act, alpha, limit, op_id, *args):  # type: ignore[override]
        out, (rt, gu) = forward(spec, act, alpha, limit, args, op_id, keep=True)
        ctx.save_for_backward(*args, gu, *(x for x in rt if x is not None))
        ctx.spec, ctx.act, ctx.alpha, ctx.limit, ctx.has_expert = spec, act, alpha, limit, rt.expert is not None
        ctx.spent = False
        return out

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        saved = ctx.saved_tensors
        args, gu, rest = saved[:7], saved[7], saved[8:]
        needs = tuple(ctx.needs_input_grad[5:12])
        if torch.is_grad_enabled():  # create_graph=True: differentiable gradients, by the torch formula
            grads = graph_grads(ctx.spec.reference, (*args, ctx.act, ctx.alpha, ctx.limit), (dy,), (*needs, False, False, False))
            return (None,) * 5 + tuple(grads[:7])
        rt = Route(*rest) if ctx.has_expert else Route(*rest, None)
        if ctx.spent:
            gu = _gate_up_again(ctx.spec, args, rt)
        ctx.spent = True
        grads = backward(ctx.spec, ctx.act, ctx.alpha, ctx.limit, dy.contiguous(), args, rt, gu, needs)
        return (None,) * 5 + tuple(grads)


_apply = lean_apply(_Experts)


def experts(spec: Spec, act: int, alpha: float, limit: float, op_id: str, args: tuple[torch.Tensor | None, ...]) -> torch.Tensor:
    """The impl's body on this path; ``args`` as :func:`forward` takes them."""
    if torch.is_grad_enabled() and any(a is not None and a.requires_grad for i, a in enumerate(args) if i != 1):
        return _apply(spec, act, alpha, limit, op_id, *args)
    return forward(spec, act, alpha, limit, args, op_id, keep=False)[0]
