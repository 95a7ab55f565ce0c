"""Row-kernel building blocks for the softmax and cross-entropy CuTeDSL kernels (torch-free).

A row is read by one CTA of ``threads`` threads, each thread moving 16-byte vectors: thread ``k``
owns columns ``[k·vec, k·vec + vec)`` of every ``threads·vec``-wide tile of the row (``vec = 16 /
element bytes``), so every global access is one 128-bit load or store. Row reductions go warp
shuffle -> one smem slot per warp -> warp shuffle, so the whole CTA gets the result.

Imports ``cutlass``: only the cute_dsl kernel modules import this, and only when selected.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
MAX_THREADS = 1024


def vec_elems(dtype: type[cutlass.Numeric]) -> int:
    """Elements in one 16-byte vector of ``dtype``."""
    return 128 // dtype.width


def row_copy(dtype: type[cutlass.Numeric], threads: int) -> cute.TiledCopy:
    """A tiled copy of a ``(1, threads·vec)`` tile: thread k moves 16 bytes at column k·vec."""
    vec = vec_elems(dtype)
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=128)
    thr = cute.make_layout((1, threads), stride=(threads, 1))
    val = cute.make_layout((1, vec), stride=(vec, 1))
    return cute.make_tiled_copy_tv(atom, thr, val)


@cute.jit
def col_pred(tXcX: cute.Tensor, n: Int32) -> cute.Tensor:
    """One flag per 16-byte vector of a thread's partition: its first column is < n.

    N is a multiple of the vector width (the predicates guarantee it), so a vector is either
    wholly inside the row or wholly outside it.
    """
    iters = cute.size(tXcX, mode=[2])
    pred = cute.make_rmem_tensor(cute.make_layout((1, 1, iters), stride=(iters, iters, 1)), cutlass.Boolean)
    for i in cutlass.range_constexpr(iters):
        pred[0, 0, i] = cute.elem_less(tXcX[(0, 0), 0, i][1], n)
    return pred


@cute.jit
def block_reduce(val: Float32, op: cutlass.Constexpr, buf: cute.Tensor, init: Float32) -> Float32:
    """Reduce one fp32 per thread over the CTA with ``op`` (every thread gets the result).

    ``buf`` is an fp32 smem array with one slot per warp, used by this call only (a second
    reduction needs a second buffer, or a barrier before reuse).
    """
    lane = cute.arch.lane_idx()
    warp = cute.arch.warp_idx()
    val = cute.arch.warp_reduction(val, op)
    if lane == 0:
        buf[warp] = val
    cute.arch.barrier()
    out = init
    if lane < cute.size(buf):
        out = buf[lane]
    return cute.arch.warp_reduction(out, op)


@cute.jit
def fmax(a: Float32, b: Float32) -> Float32:
    return cute.arch.fmax(a, b)


@cute.jit
def fadd(a: Float32, b: Float32) -> Float32:
    return a + b
