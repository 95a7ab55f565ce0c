"""cuTile softmax over the last dim: forward only (the op's backward goes to other impls).

Rows of up to ONE_TILE_N elements live in one tile (TM rows per block): max, exp, sum, divide.
Longer rows take two passes over CHUNK_N-wide chunks: an online max and sum (the running sum
rescaled by exp(m_old - m_new)), then exp(x - m) / s; the second read of a row mostly hits L2.
Padding is -inf, whose exp is 0; the running max starts at the lowest finite fp32, so chunks of
only -inf (masked attention) give exp(-inf) = 0 rather than NaN, and a row of only -inf gives
0/0 = NaN, as the reference does.
"""

from __future__ import annotations

import cuda.tile as ct
import torch

from ._host import launch, pow2, row_chunks, rows

ONE_TILE_N = 8192
CHUNK_N = 4096
TILE_ELEMS = 8192
NEG_INF = ct.PaddingMode.NEG_INF
_LOWEST = -3.4028234663852886e38


# ---------------------------------------------------------------------------------------------
# Kernels


@ct.kernel
def _softmax_tile(X, Y, TM: ct.Constant[int], TN: ct.Constant[int]):
    bm = ct.bid(0)
    x = ct.astype(ct.load(X, index=(bm, 0), shape=(TM, TN), padding_mode=NEG_INF), ct.float32)
    e = ct.exp(x - ct.max(x, axis=1, keepdims=True))
    ct.store(Y, index=(bm, 0), tile=ct.astype(e / ct.sum(e, axis=1, keepdims=True), Y.dtype))


@ct.kernel
def _softmax_chunked(X, Y, TN: ct.Constant[int]):
    row = ct.bid(0)
    chunks = ct.cdiv(X.shape[1], TN)
    m = ct.full((1, 1), _LOWEST, dtype=ct.float32)
    s = ct.full((1, 1), 0.0, dtype=ct.float32)
    for j in range(chunks):
        x = ct.astype(ct.load(X, index=(row, j), shape=(1, TN), padding_mode=NEG_INF), ct.float32)
        m_new = ct.maximum(m, ct.max(x, axis=1, keepdims=True))
        s = s * ct.exp(m - m_new) + ct.sum(ct.exp(x - m_new), axis=1, keepdims=True)
        m = m_new
    for j in range(chunks):
        x = ct.astype(ct.load(X, index=(row, j), shape=(1, TN), padding_mode=NEG_INF), ct.float32)
        ct.store(Y, index=(row, j), tile=ct.astype(ct.exp(x - m) / s, Y.dtype))


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
