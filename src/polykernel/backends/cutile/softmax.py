"""cuTile softmax over the last dim: forward only (the op's backward goes to other impls).

Rows of up to ONE_TILE_N elements live in one tile (TM rows per block): max, exp, sum, divide.
Longer rows take two passes over CHUNK_N-wide chunks: an online max and sum (the running sum
rescaled by exp(m_old - m_new)), then exp(x - m) / s; the second read of a row mostly hits L2.
Padding is -inf, whose exp is 0; the running max starts at the lowest finite fp32, so chunks of
only -inf (masked attention) give exp(-inf) = 0 rather than NaN, and a row of only -inf gives
0/0 = NaN, as the reference does.

exp is 2^(x·log2 e) with ex2.approx (flush-to-zero) and each row is scaled by one approximate
reciprocal of its sum, as Triton's softmax does: the exact exp and division doubled the
registers (255 per thread at 256 threads, one block per SM on sm_90). Loads and stores skip TMA
(one streaming pass per tile).
"""

from __future__ import annotations

import cuda.tile as ct
import torch

from ._host import launch, pow2, row_chunks, rows

ONE_TILE_N = 8192
CHUNK_N = 2048  # sm_90: 80 registers at 128 threads (4096: 132)
TILE_ELEMS = 8192
NEG_INF = ct.PaddingMode.NEG_INF
APPROX = ct.RoundingMode.APPROX
_LOG2E = 1.4426950408889634
_LOWEST = -3.4028234663852886e38


# ---------------------------------------------------------------------------------------------
# Kernels


@ct.function
def _exp(z):
    return ct.exp2(z * _LOG2E, flush_to_zero=True)


@ct.function
def _inv(s):
    return ct.truediv(1.0, s, flush_to_zero=True, rounding_mode=APPROX)


@ct.function
def _ld(X, index, shape):
    return ct.astype(ct.load(X, index=index, shape=shape, padding_mode=NEG_INF, allow_tma=False), ct.float32)


@ct.kernel
def _softmax_tile(X, Y, TM: ct.Constant[int], TN: ct.Constant[int]):
    bm = ct.bid(0)
    x = _ld(X, (bm, 0), (TM, TN))
    e = _exp(x - ct.max(x, axis=1, keepdims=True))
    ct.store(Y, index=(bm, 0), tile=ct.astype(e * _inv(ct.sum(e, axis=1, keepdims=True)), Y.dtype), allow_tma=False)


@ct.kernel
def _softmax_chunked(X, Y, TN: ct.Constant[int]):
    row = ct.bid(0)
    chunks = ct.cdiv(X.shape[1], TN)
    m = ct.full((1, 1), _LOWEST, dtype=ct.float32)
    s = ct.full((1, 1), 0.0, dtype=ct.float32)
    for j in range(chunks):
        x = _ld(X, (row, j), (1, TN))
        m_new = ct.maximum(m, ct.max(x, axis=1, keepdims=True))
        s = s * _exp(m - m_new) + ct.sum(_exp(x - m_new), axis=1, keepdims=True)
        m = m_new
    r = _inv(s)
    for j in range(chunks):
        x = _ld(X, (row, j), (1, TN))
        ct.store(Y, index=(row, j), tile=ct.astype(_exp(x - m) * r, Y.dtype), allow_tma=False)


# ---------------------------------------------------------------------------------------------
# Host launcher


def softmax_forward(x2: torch.Tensor) -> torch.Tensor:
    """softmax of each row of ``x2`` [M, N] (any strides), contiguous, in x's dtype."""
    m, n = x2.shape
    y = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    for r0, r1 in row_chunks(m, n):
        if pow2(n) <= ONE_TILE_N:
            tn = pow2(n)
            tm = min(pow2(r1 - r0), max(1, TILE_ELEMS // tn))
            launch(((r1 - r0 + tm - 1) // tm,), _softmax_tile, x2[r0:r1], y[r0:r1], tm, tn)
        else:
            launch((r1 - r0,), _softmax_chunked, x2[r0:r1], y[r0:r1], CHUNK_N)
    return y


# ---------------------------------------------------------------------------------------------
# Registered impl


def softmax(x: torch.Tensor) -> torch.Tensor:
    """The registered impl (forward only: its spec declares no backward, so the dispatcher never
    picks it when x requires grad)."""
    if x.numel() == 0:
        return torch.empty_like(x)
    n = x.shape[-1] if x.dim() else 1
    return softmax_forward(rows(x, n)).view(x.shape)
