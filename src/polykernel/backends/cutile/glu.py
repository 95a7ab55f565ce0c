"""cuTile gated linear units: ``act(gate) * up`` and its backward, shared by swiglu and geglu.

One elementwise kernel per direction over ``[M, N]`` views (any row and column strides: cuTile
arrays carry their strides), specialized on the activation (``ACT``: silu, gelu-tanh, gelu-erf).
Math in fp32, outputs in the inputs' dtype; the backward recomputes the activation from gate and
writes dgate and dup in one pass (reads 3 tensors, writes 2; the forward moves 3).

cuTile has no erf: the exact GELU uses erfc(z) = t·exp(-z² + P(t)), t = 1/(1 + |z|/2) (the
Chebyshev fit of Numerical Recipes §6.2, relative error < 1.2e-7 everywhere), and takes
Φ(g) = erfc(-g/√2)/2 for g < 0 (no cancellation) and 1 - erfc(g/√2)/2 otherwise.
"""

from __future__ import annotations

import cuda.tile as ct
import torch

from ._host import launch, pow2, row_chunks, rows

SILU, GELU_TANH, GELU_ERF = 0, 1, 2
ACTS = {"silu": SILU, "tanh": GELU_TANH, "none": GELU_ERF}
TILE_ELEMS = 4096  # elements per block (bf16: 8 KiB per tensor)
MAX_TN = 1024

_K2 = 1.5957691216057308  # 2·√(2/π): 0.5·(1 + tanh z) = sigmoid(2z), 2z = g·(K2 + K2C·g²)
_K2C = 0.0713548162726009  # 2·√(2/π)·0.044715
_K2C3 = 0.2140644488178027  # 3·_K2C
_INV_SQRT_2 = 0.7071067811865476
_INV_SQRT_2PI = 0.3989422804014327


# ---------------------------------------------------------------------------------------------
# Kernels


@ct.function
def _sigmoid(z):
    return 1.0 / (1.0 + ct.exp(-z))


@ct.function
def _phi(g):
    """Φ(g), the normal CDF, from erfc (see the module docstring), fp32."""
    z = ct.abs(g) * _INV_SQRT_2
    t = 1.0 / (1.0 + 0.5 * z)
    p = -1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (-0.18628806 + t * (
        0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277))))))))  # fmt: skip
    half_erfc = 0.5 * t * ct.exp(p - z * z)
    return ct.where(g < 0.0, half_erfc, 1.0 - half_erfc)


@ct.function
def _act(g, ACT):
    """act(g) in fp32."""
    if ACT == 0:
        a = g * _sigmoid(g)
    elif ACT == 1:
        a = g * _sigmoid(g * (g * g * _K2C + _K2))
    else:
        a = g * _phi(g)
    return a


@ct.function
def _act_grad(g, ACT):
    """act'(g) in fp32."""
    if ACT == 0:
        s = _sigmoid(g)
        d = s * (1.0 + g * (1.0 - s))
    elif ACT == 1:
        g2 = g * g
        cdf = _sigmoid(g * (g2 * _K2C + _K2))
        d = cdf + g * (cdf * (1.0 - cdf)) * (g2 * _K2C3 + _K2)
    else:
        d = _phi(g) + g * (ct.exp(g * g * -0.5) * _INV_SQRT_2PI)
    return d


@ct.kernel
def _glu_fwd_kernel(G, U, Y, ACT: ct.Constant[int], TM: ct.Constant[int], TN: ct.Constant[int]):
    bm, bn = ct.bid(0), ct.bid(1)
    g = ct.astype(ct.load(G, index=(bm, bn), shape=(TM, TN), padding_mode=ct.PaddingMode.ZERO), ct.float32)
    u = ct.astype(ct.load(U, index=(bm, bn), shape=(TM, TN), padding_mode=ct.PaddingMode.ZERO), ct.float32)
    ct.store(Y, index=(bm, bn), tile=ct.astype(_act(g, ACT) * u, Y.dtype))


@ct.kernel
def _glu_bwd_kernel(G, U, DY, DG, DU, ACT: ct.Constant[int], TM: ct.Constant[int], TN: ct.Constant[int]):
    bm, bn = ct.bid(0), ct.bid(1)
    g = ct.astype(ct.load(G, index=(bm, bn), shape=(TM, TN), padding_mode=ct.PaddingMode.ZERO), ct.float32)
    u = ct.astype(ct.load(U, index=(bm, bn), shape=(TM, TN), padding_mode=ct.PaddingMode.ZERO), ct.float32)
    dy = ct.astype(ct.load(DY, index=(bm, bn), shape=(TM, TN), padding_mode=ct.PaddingMode.ZERO), ct.float32)
    ct.store(DG, index=(bm, bn), tile=ct.astype(dy * u * _act_grad(g, ACT), DG.dtype))
    ct.store(DU, index=(bm, bn), tile=ct.astype(dy * _act(g, ACT), DU.dtype))


# ---------------------------------------------------------------------------------------------
# Host launcher


def tiles(m: int, n: int) -> tuple[int, int]:
    """(TM, TN): up to TILE_ELEMS elements per block, several rows when rows are short."""
    tn = min(MAX_TN, pow2(n))
    return min(pow2(m), max(1, TILE_ELEMS // tn)), tn


def _run(kernel, tensors: list[torch.Tensor], act: int) -> None:
    """Launch ``kernel`` over same-shape ``[M, N]`` tensors (inputs first, then outputs)."""
    m, n = tensors[0].shape
    for r0, r1 in row_chunks(m, n):
        part = [t[r0:r1] for t in tensors]
        tm, tn = tiles(r1 - r0, n)
        launch(((r1 - r0 + tm - 1) // tm, (n + tn - 1) // tn), kernel, *part, act, tm, tn)


def _n(t: torch.Tensor) -> int:
    return t.shape[-1] if t.dim() else 1


def glu_forward(gate: torch.Tensor, up: torch.Tensor, act: int) -> torch.Tensor:
    """``act(gate) * up`` in gate's shape and dtype (a contiguous result)."""
    y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if y.numel():
        n = _n(gate)
        _run(_glu_fwd_kernel, [rows(gate, n), rows(up, n), y.view(-1, n)], act)
    return y


def glu_backward(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, act: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dup) in the inputs' dtype, recomputing act(gate) from gate."""
    dg = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    du = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if dg.numel():
        n = _n(gate)
        _run(_glu_bwd_kernel, [rows(gate, n), rows(up, n), rows(dy, n), dg.view(-1, n), du.view(-1, n)], act)
    return dg, du


# ---------------------------------------------------------------------------------------------
# Registered impl (through swiglu.py / geglu.py)


class GLUFunction(torch.autograd.Function):
    """autograd for ``act(gate) * up``; saves only gate and up."""

    @staticmethod
    def forward(ctx, gate, up, act):  # type: ignore[override]
        ctx.save_for_backward(gate, up)
        ctx.act = act
        return glu_forward(gate, up, act)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        gate, up = ctx.saved_tensors
        dg, du = glu_backward(dy, gate, up, ctx.act)
        return (dg if ctx.needs_input_grad[0] else None, du if ctx.needs_input_grad[1] else None, None)


def glu(gate: torch.Tensor, up: torch.Tensor, act: int) -> torch.Tensor:
    """Forward (with autograd when a grad is needed) of ``act(gate) * up``; args validated."""
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return GLUFunction.apply(gate, up, act)
    return glu_forward(gate, up, act)
