"""Column sums of the norms' fp32 partial-gradient buffers, cast to the parameter's dtype.

The norm backwards leave dW (and dB) as a [P, N] fp32 buffer, one row per program. Summing it
with ``part.sum(0).to(dtype)`` costs two torch ops on the host per parameter (each ~10-30 µs on
the H200 host, host_profile.py); this is one launch through the fast path. Each program owns a
block of columns and walks the P rows in a fixed order: deterministic, like the kernels before it.

Example::

    dw = colsum(part, weight.dtype)   # == part.sum(0).to(weight.dtype), up to fp32 rounding order
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import launch
from ._rows import cdiv as _cdiv

BLOCK_C = 64  # columns per program: N=4096 gives 64 programs, enough to read 4 MiB quickly
BLOCK_P = 32  # rows per step
META = dict(BLOCK_C=BLOCK_C, BLOCK_P=BLOCK_P, num_warps=4)  # the launch's keywords (also the native path's)


@triton.jit
def _colsum_kernel(PART, OUT, P, N, BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < N
    acc = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
    for start in range(0, P, BLOCK_P):
        rows = start + tl.arange(0, BLOCK_P)
        mask = (rows < P)[:, None] & col_ok[None, :]
        acc += tl.load(PART + rows.to(tl.int64)[:, None] * N + cols[None, :], mask=mask, other=0.0)
    tl.store(OUT + cols, tl.sum(acc, axis=0).to(OUT.dtype.element_ty), mask=col_ok)


def colsum(part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``part.sum(0)`` of a contiguous [P, N] fp32 buffer (P >= 1), as a new [N] tensor of ``dtype``."""
    p, n = part.shape
    out = torch.empty(n, dtype=dtype, device=part.device)
    launch(_colsum_kernel, (_cdiv(n, BLOCK_C),), part, out, p, n, **META)
    return out
