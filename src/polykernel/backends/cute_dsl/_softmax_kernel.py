"""CuTeDSL softmax kernels (torch-free; imported only when the cute_dsl softmax is selected).

One CTA per row, the whole row in registers (N <= MAX_N: at most 32 fp32 values a thread at 1024
threads), so the forward reads x once and writes y once:

* forward: 128-bit loads of the row, row max (warp shuffle + smem), ``e = exp2((x - max)·log2 e)``
  (the max is subtracted before scaling, so logits of 1e4 keep fp32 accuracy), row sum, ``y = e /
  sum``; writes y and the row's (max, 1/sum) in fp32 for the backward.
* backward: ``dx = y·(dy - Σ y·dy)`` with y recomputed in fp32 from x and the saved (max, 1/sum),
  as the Triton impl does: the contract's gradient is the fp32 one, a y rounded to bf16 would
  carry its rounding into the row dot. Same bytes as reading y (x instead of y).

Columns past N (N is a multiple of 16 bytes; the last tile may be partial) are predicated off
per 16-byte vector and filled with -inf (x) or 0 (dy), so they add nothing to the reductions.

``compile_forward(dtype, n)`` / ``compile_backward(dtype, n)`` compile once per (dtype name, N)
for the arch CuTeDSL targets, with the row count dynamic and TVM-FFI calling convention: the
compiled function takes torch tensors directly and launches on torch's current stream.
"""

from __future__ import annotations

import functools

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from ._common import fake_rows
from ._rowops import LOG2E, MAX_THREADS, block_reduce, col_pred, fadd, fmax, row_copy, vec_elems

MAX_N = 32768  # 32 fp32 values a thread at 1024 threads: the register budget of one row
DTYPES = {"float32": cutlass.Float32, "bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}


def launch_shape(n: int, vec: int) -> tuple[int, int]:
    """(threads, vectors a thread) for a row of n elements: as few vectors a thread as 1024
    threads allow, threads a multiple of 32."""
    nv = -(-n // vec)
    iters = -(-nv // MAX_THREADS)
    threads = -(-nv // iters)
    return max(32, -(-threads // 32) * 32), iters


class _SoftmaxFwd:
    """Host side of the forward kernel for one (dtype, N): ``__call__`` is traced by cute.compile."""

    def __init__(self, dtype: type[cutlass.Numeric], n: int):
        self.dtype, self.n = dtype, n
        self.threads, self.iters = launch_shape(n, vec_elems(dtype))

    @cute.jit
    def __call__(self, mX: cute.Tensor, mY: cute.Tensor, mMax: cute.Tensor, mInv: cute.Tensor, stream):
        tiled_copy = row_copy(self.dtype, self.threads)
        self.kernel(mX, mY, mMax, mInv, tiled_copy).launch(grid=[cute.size(mX, mode=[0]), 1, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mY: cute.Tensor, mMax: cute.Tensor, mInv: cute.Tensor, tiled_copy: cute.TiledCopy):
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        tile = (1, self.threads * vec_elems(self.dtype) * self.iters)
        even = const_expr(tile[1] == self.n)

        smem = cutlass.utils.SmemAllocator()
        warps = self.threads // 32
        buf_max = smem.allocate_tensor(Float32, cute.make_layout(warps), byte_alignment=16)
        buf_sum = smem.allocate_tensor(Float32, cute.make_layout(warps), byte_alignment=16)

        thr = tiled_copy.get_slice(tidx)
        tXgX = thr.partition_S(cute.local_tile(mX, tile, (row, 0)))
        tXgY = thr.partition_D(cute.local_tile(mY, tile, (row, 0)))
        tXcX = thr.partition_S(cute.local_tile(cute.make_identity_tensor(mX.shape), tile, (row, 0)))
        tXrX = cute.make_rmem_tensor_like(tXgX)
        tXrY = cute.make_rmem_tensor_like(tXgY)

        if const_expr(even):
            cute.copy(tiled_copy, tXgX, tXrX)
        else:
            pred = col_pred(tXcX, self.n)
            tXrX.fill(-Float32.inf)
            cute.copy(tiled_copy, tXgX, tXrX, pred=pred)

        x = tXrX.load().to(Float32)
        m = block_reduce(x.reduce(cute.ReductionOp.MAX, -Float32.inf, 0), fmax, buf_max, -Float32.inf)
        e = cute.math.exp2((x - m) * LOG2E, fastmath=True)
        s = block_reduce(e.reduce(cute.ReductionOp.ADD, Float32(0.0), 0), fadd, buf_sum, Float32(0.0))
        inv = Float32(1.0) / s
        tXrY.store((e * inv).to(self.dtype))

        if const_expr(even):
            cute.copy(tiled_copy, tXrY, tXgY)
        else:
            cute.copy(tiled_copy, tXrY, tXgY, pred=pred)
        if tidx == 0:
            mMax[row] = m
            mInv[row] = inv


class _SoftmaxBwd:
    """Host side of the backward kernel for one (dtype, N)."""

    def __init__(self, dtype: type[cutlass.Numeric], n: int):
        self.dtype, self.n = dtype, n
        self.threads, self.iters = launch_shape(n, vec_elems(dtype))

    @cute.jit
    def __call__(self, mX: cute.Tensor, mDY: cute.Tensor, mMax: cute.Tensor, mInv: cute.Tensor, mDX: cute.Tensor, stream):
        tiled_copy = row_copy(self.dtype, self.threads)
        self.kernel(mX, mDY, mMax, mInv, mDX, tiled_copy).launch(
            grid=[cute.size(mX, mode=[0]), 1, 1], block=[self.threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mDY: cute.Tensor, mMax: cute.Tensor, mInv: cute.Tensor, mDX: cute.Tensor, tiled_copy: cute.TiledCopy):
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        tile = (1, self.threads * vec_elems(self.dtype) * self.iters)
        even = const_expr(tile[1] == self.n)

        smem = cutlass.utils.SmemAllocator()
        buf_dot = smem.allocate_tensor(Float32, cute.make_layout(self.threads // 32), byte_alignment=16)

        thr = tiled_copy.get_slice(tidx)
        tXgX = thr.partition_S(cute.local_tile(mX, tile, (row, 0)))
        tXgDY = thr.partition_S(cute.local_tile(mDY, tile, (row, 0)))
        tXgDX = thr.partition_D(cute.local_tile(mDX, tile, (row, 0)))
        tXcX = thr.partition_S(cute.local_tile(cute.make_identity_tensor(mX.shape), tile, (row, 0)))
        tXrX = cute.make_rmem_tensor_like(tXgX)
        tXrDY = cute.make_rmem_tensor_like(tXgDY)
        tXrDX = cute.make_rmem_tensor_like(tXgDX)

        if const_expr(even):
            cute.copy(tiled_copy, tXgX, tXrX)
            cute.copy(tiled_copy, tXgDY, tXrDY)
        else:
            pred = col_pred(tXcX, self.n)
            tXrX.fill(-Float32.inf)
            tXrDY.fill(0.0)
            cute.copy(tiled_copy, tXgX, tXrX, pred=pred)
            cute.copy(tiled_copy, tXgDY, tXrDY, pred=pred)

        m = mMax[row]
        inv = mInv[row]
        y = cute.math.exp2((tXrX.load().to(Float32) - m) * LOG2E, fastmath=True) * inv
        dy = tXrDY.load().to(Float32)
        dot = block_reduce((y * dy).reduce(cute.ReductionOp.ADD, Float32(0.0), 0), fadd, buf_dot, Float32(0.0))
        tXrDX.store((y * (dy - dot)).to(self.dtype))

        if const_expr(even):
            cute.copy(tiled_copy, tXrDX, tXgDX)
        else:
            cute.copy(tiled_copy, tXrDX, tXgDX, pred=pred)


def _rows(dtype: type[cutlass.Numeric], n: int) -> cute.Tensor:
    """A fake [M, n] row-major tensor, M dynamic, 16-byte aligned (the host guarantees it), by a
    runtime int64 row stride: with the static n of a compact layout CuTeDSL computes row * n +
    column in 32 bits, which wraps past 2^32 elements (N = 32768: row 131072 on)."""
    return fake_rows(dtype, cute.sym_int(), n)


def _stats() -> cute.Tensor:
    return cute.runtime.make_fake_compact_tensor(Float32, (cute.sym_int(),), assumed_align=4)


def _stream():
    return cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)


@functools.cache
def compile_forward(dtype: str, n: int):
    """The compiled forward for (dtype name, N): ``f(x2, y, rmax, rinv)`` on torch tensors."""
    dt = DTYPES[dtype]
    return cute.compile(_SoftmaxFwd(dt, n), _rows(dt, n), _rows(dt, n), _stats(), _stats(), _stream(), options="--enable-tvm-ffi")


@functools.cache
def compile_backward(dtype: str, n: int):
    """The compiled backward for (dtype name, N): ``f(x2, dy2, rmax, rinv, dx)`` on torch tensors."""
    dt = DTYPES[dtype]
    return cute.compile(
        _SoftmaxBwd(dt, n), _rows(dt, n), _rows(dt, n), _stats(), _stats(), _rows(dt, n), _stream(), options="--enable-tvm-ffi"
    )
