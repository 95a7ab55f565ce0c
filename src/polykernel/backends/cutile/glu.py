"""cuTile gated linear units: ``act(gate) * up`` and its backward, shared by swiglu and geglu.

Two kernels per direction, specialized on the activation (``ACT``: silu, gelu-tanh, gelu-erf):

* flat: when every tensor is contiguous (the usual case), the tensors are viewed as 1-D and each
  block takes FLAT_BLOCK consecutive elements. Rows do not matter to an elementwise op, so this is
  one large, 16-byte-aligned chunk per block whatever N is (no ragged row ends), and one compiled
  kernel serves every contiguous shape of a dtype.
* rows: other layouts (fused gate/up halves, transposed, column-strided views) as ``[M, N]`` views
  with their strides (cuTile arrays carry them), ``[TM, TN]`` tiles.

Loads and stores skip TMA: each block streams its chunk once, and plain vector loads are the
structure that reaches copy bandwidth for elementwise kernels. exp and the sigmoid's division use
the approximate fp32 forms (ex2.approx, approximate reciprocal), as Triton's ``tl.exp`` and ``/``
do: the exact IEEE division costs more instructions per element than a streaming kernel can spend
at 4 TB/s. Math in fp32, outputs in the inputs' dtype; the backward recomputes the activation from
gate and writes dgate and dup in one pass (reads 3 tensors, writes 2; the forward moves 3).

cuTile has no erf: the exact GELU uses erfc(z) = t·exp(-z² + P(t)), t = 1/(1 + |z|/2) (the
Chebyshev fit of Numerical Recipes §6.2, relative error < 1.2e-7 everywhere), and takes
Φ(g) = erfc(-g/√2)/2 for g < 0 (no cancellation) and 1 - erfc(g/√2)/2 otherwise.
"""

from __future__ import annotations

import cuda.tile as ct
import torch

from .._functions import glu_function
from ._host import MAX_ELEMS, launch, pow2, row_chunks, rows

SILU, GELU_TANH, GELU_ERF = 0, 1, 2
ACTS = {"silu": SILU, "tanh": GELU_TANH, "none": GELU_ERF}
FLAT_BLOCK = (
    1024  # flat path: 8 elements per thread at 128 threads (inductor's pointwise block); sm_90: 32 registers (4096: 120, 4 blocks per SM)
)
TILE_ELEMS = FLAT_BLOCK  # elements per block on the rows path (several rows when rows are short)
MAX_TN = 1024
ZERO = ct.PaddingMode.ZERO
APPROX = ct.RoundingMode.APPROX
_LOG2E = 1.4426950408889634

_K2 = 1.5957691216057308  # 2·√(2/π): 0.5·(1 + tanh z) = sigmoid(2z), 2z = g·(K2 + K2C·g²)
_K2C = 0.0713548162726009  # 2·√(2/π)·0.044715
_K2C3 = 0.2140644488178027  # 3·_K2C
_INV_SQRT_2 = 0.7071067811865476
_INV_SQRT_2PI = 0.3989422804014327


# ---------------------------------------------------------------------------------------------
# Kernels


@ct.function
def _exp(z):
    """exp(z) as 2^(z·log2 e) with ex2.approx (flush-to-zero), fp32."""
    return ct.exp2(z * _LOG2E, flush_to_zero=True)


@ct.function
def _sigmoid(z):
    return ct.truediv(1.0, 1.0 + _exp(-z), flush_to_zero=True, rounding_mode=APPROX)


@ct.function
def _phi(g):
    """Φ(g), the normal CDF, from erfc (see the module docstring), fp32."""
    z = ct.abs(g) * _INV_SQRT_2
    t = ct.truediv(1.0, 1.0 + 0.5 * z, flush_to_zero=True, rounding_mode=APPROX)
    p = -1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (-0.18628806 + t * (
        0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277))))))))  # fmt: skip
    half_erfc = 0.5 * t * _exp(p - z * z)
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
        d = _phi(g) + g * (_exp(g * g * -0.5) * _INV_SQRT_2PI)
    return d


@ct.function
def _ld(A, index, shape):
    """A tile of A in fp32 (zero past the edges), by plain vector loads (no TMA)."""
    return ct.astype(ct.load(A, index=index, shape=shape, padding_mode=ZERO, allow_tma=False), ct.float32)


@ct.function
def _st(A, index, tile):
    ct.store(A, index=index, tile=ct.astype(tile, A.dtype), allow_tma=False)


@ct.kernel
def _glu_fwd_flat(G, U, Y, ACT: ct.Constant[int], B: ct.Constant[int]):
    i = ct.bid(0)
    g = _ld(G, (i,), (B,))
    _st(Y, (i,), _act(g, ACT) * _ld(U, (i,), (B,)))


@ct.kernel
def _glu_bwd_flat(G, U, DY, DG, DU, ACT: ct.Constant[int], B: ct.Constant[int]):
    i = ct.bid(0)
    g = _ld(G, (i,), (B,))
    dy = _ld(DY, (i,), (B,))
    _st(DG, (i,), dy * _ld(U, (i,), (B,)) * _act_grad(g, ACT))
    _st(DU, (i,), dy * _act(g, ACT))


@ct.kernel
def _glu_fwd_kernel(G, U, Y, ACT: ct.Constant[int], TM: ct.Constant[int], TN: ct.Constant[int]):
    bm, bn = ct.bid(0), ct.bid(1)
    g = _ld(G, (bm, bn), (TM, TN))
    _st(Y, (bm, bn), _act(g, ACT) * _ld(U, (bm, bn), (TM, TN)))


@ct.kernel
def _glu_bwd_kernel(G, U, DY, DG, DU, ACT: ct.Constant[int], TM: ct.Constant[int], TN: ct.Constant[int]):
    bm, bn = ct.bid(0), ct.bid(1)
    g = _ld(G, (bm, bn), (TM, TN))
    dy = _ld(DY, (bm, bn), (TM, TN))
    _st(DG, (bm, bn), dy * _ld(U, (bm, bn), (TM, TN)) * _act_grad(g, ACT))
    _st(DU, (bm, bn), dy * _act(g, ACT))


# ---------------------------------------------------------------------------------------------
# Host launcher


def tiles(m: int, n: int) -> tuple[int, int]:
    """(TM, TN): up to TILE_ELEMS elements per block, several rows when rows are short."""
    tn = min(MAX_TN, pow2(n))
    return min(pow2(m), max(1, TILE_ELEMS // tn)), tn


def _run_flat(kernel, tensors: list[torch.Tensor], act: int) -> None:
    """Launch the flat ``kernel`` over same-shape contiguous tensors (inputs first, then outputs)."""
    flat = [t.view(-1) for t in tensors]
    total = flat[0].numel()
    step = MAX_ELEMS // FLAT_BLOCK * FLAT_BLOCK  # int32 indexing per launch; chunks stay block-aligned
    for s0 in range(0, total, step):
        part = [t[s0 : s0 + step] for t in flat]
        launch(((part[0].numel() + FLAT_BLOCK - 1) // FLAT_BLOCK,), kernel, *part, act, FLAT_BLOCK)


def _run(flat_kernel, kernel, tensors: list[torch.Tensor], act: int) -> None:
    """Launch over same-shape tensors (inputs first, then fresh contiguous outputs): the flat kernel
    when every input is contiguous, else ``kernel`` over ``[M, N]`` row views."""
    if all(t.is_contiguous() for t in tensors):
        _run_flat(flat_kernel, tensors, act)
        return
    n = _n(tensors[0])
    tensors = [rows(t, n) for t in tensors]
    m = tensors[0].shape[0]
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
        _run(_glu_fwd_flat, _glu_fwd_kernel, [gate, up, y], act)
    return y


def glu_backward(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, act: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dup) in the inputs' dtype, recomputing act(gate) from gate."""
    dg = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    du = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if dg.numel():
        _run(_glu_bwd_flat, _glu_bwd_kernel, [gate, up, dy, dg, du], act)
    return dg, du


# ---------------------------------------------------------------------------------------------
# Registered impl (through swiglu.py / geglu.py)


GLUFunction = glu_function(glu_forward, glu_backward)  # the autograd node, shared with the other kernel backends


def glu(gate: torch.Tensor, up: torch.Tensor, act: int) -> torch.Tensor:
    """Forward (with autograd when a grad is needed) of ``act(gate) * up``; args validated."""
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return GLUFunction.apply(gate, up, act)
    return glu_forward(gate, up, act)
