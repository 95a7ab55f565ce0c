"""CuTeDSL cross-entropy kernel (torch-free; imported only when the cute_dsl impl is launched).

One CTA per row of ``V`` logits, walked in chunks of ``threads·vec·iters`` columns with 128-bit
loads. One kernel, two passes chosen at compile time (``grad``):

* forward (``grad=False``): each thread keeps a running max and ``Σ exp(x - max)`` over its
  columns (one rescale per chunk, one exp per element), then the CTA merges them (max, then
  rescaled sums) into the row's LSE; with label smoothing also the row sum. Thread 0 loads the
  target logit and writes the row's loss and LSE (fp32). Ignored rows read nothing: loss 0, LSE 0.
* backward (``grad=True``): from the saved LSE, writes ``(exp(x - lse) - ε/V) · scale`` for every
  column and then, from the thread that stored the target's vector (so after it, in that thread's
  program order), the target column ``(exp(x_t - lse) - ε/V - (1 - ε)) · scale``. Everything is
  fp32 up to the store, so each dlogit is rounded to the logits' dtype once (the error model
  allows one rounding). ``scale`` (fp32 in device memory: one value or one per row, so no host
  sync) already holds grad_output and the mean's 1/count. Ignored rows get zeros without reading
  the logits.

There is no forward-writes-the-gradient schedule: it needs grad_output before it exists, so it
stored dlogits for grad_output = 1 in the logits' dtype and scaled them afterwards (two roundings:
past the bf16/fp16 tolerance on the H200), and it was 3.5x slower than forward + this backward
at 8192x128256 (although the forward's second read of each row was meant to hit L2).

A target neither in [0, V) nor ignore_index is never dereferenced: that row's loss and gradient
are NaN.
"""

from __future__ import annotations

import functools

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from ._common import fake_rows
from ._rowops import LN2, LOG2E, block_reduce, col_pred, fadd, fmax, row_copy, vec_elems

CHUNK_VECS = 2048  # 16-byte vectors a chunk: 512 threads x 4 (16K bf16 / 8K fp32 columns)
MAX_THREADS_CE = 512  # 2 CTAs an SM at <= 64 registers a thread
FLT_MAX = 3.4028234663852886e38
DTYPES = {"float32": cutlass.Float32, "bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}
TDTYPES = {"int64": cutlass.Int64, "int32": cutlass.Int32}


def chunk_shape(v: int, vec: int) -> tuple[int, int, int]:
    """(threads, vectors a thread a chunk, chunks) for rows of v columns."""
    per_chunk = min(_cdiv(v, vec), CHUNK_VECS)
    iters = _cdiv(per_chunk, MAX_THREADS_CE)
    threads = max(32, _cdiv(_cdiv(per_chunk, iters), 32) * 32)
    return threads, iters, _cdiv(v, threads * vec * iters)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _CrossEntropy:
    """Host side of the kernel for one (dtype, V, target dtype, pass, options)."""

    def __init__(self, dtype, v: int, tdtype, grad: bool, smooth: bool, per_row: bool):
        self.dtype, self.v, self.tdtype = dtype, v, tdtype
        self.grad, self.smooth, self.per_row = grad, smooth, per_row
        self.vec = vec_elems(dtype)
        self.threads, self.iters, self.chunks = chunk_shape(v, self.vec)
        self.chunk = self.threads * self.vec * self.iters

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,
        mT: cute.Tensor,
        mLoss: cute.Tensor,
        mLse: cute.Tensor,
        mDX: cute.Tensor,
        mScale: cute.Tensor,
        ignore_index: Int64,
        smoothing: Float32,
        stream,
    ):
        tiled_copy = row_copy(self.dtype, self.threads)
        self.kernel(mX, mT, mLoss, mLse, mDX, mScale, ignore_index, smoothing, tiled_copy).launch(
            grid=[cute.size(mX, mode=[0]), 1, 1], block=[self.threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        mX: cute.Tensor,
        mT: cute.Tensor,
        mLoss: cute.Tensor,
        mLse: cute.Tensor,
        mDX: cute.Tensor,
        mScale: cute.Tensor,
        ignore_index: Int64,
        smoothing: Float32,
        tiled_copy: cute.TiledCopy,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        tile = (1, self.chunk)
        thr = tiled_copy.get_slice(tidx)
        ident = cute.make_identity_tensor(mX.shape)

        t = Int64(mT[row])
        valid = t != ignore_index
        in_range = (t >= 0) & (t < self.v)
        bad = valid & ((t < 0) | (t >= self.v))

        smem = cutlass.utils.SmemAllocator()
        warps = self.threads // 32
        buf_max = smem.allocate_tensor(Float32, cute.make_layout(warps), byte_alignment=16)
        buf_sum = smem.allocate_tensor(Float32, cute.make_layout(warps), byte_alignment=16)
        buf_sx = smem.allocate_tensor(Float32, cute.make_layout(warps), byte_alignment=16)

        tXrX = cute.make_rmem_tensor_like(thr.partition_S(cute.local_tile(mX, tile, (row, 0))))
        if const_expr(not self.grad):
            m = Float32(-FLT_MAX)  # finite: exp2((m - m_new)·log2 e) never sees -inf - -inf
            s = Float32(0.0)
            sx = Float32(0.0)
            if valid:
                for c in cutlass.range(self.chunks, unroll=1):
                    tXgX = thr.partition_S(cute.local_tile(mX, tile, (row, c)))
                    pred = col_pred(thr.partition_S(cute.local_tile(ident, tile, (row, c))), self.v)
                    tXrX.fill(-Float32.inf)
                    cute.copy(tiled_copy, tXgX, tXrX, pred=pred)
                    x = tXrX.load().to(Float32)
                    m_new = cute.arch.fmax(m, x.reduce(cute.ReductionOp.MAX, -Float32.inf, 0))
                    e = cute.math.exp2((x - m_new) * LOG2E, fastmath=True)
                    s = s * cute.math.exp2((m - m_new) * LOG2E, fastmath=True) + e.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                    m = m_new
                    if const_expr(self.smooth):
                        for i in cutlass.range_constexpr(cute.size(tXrX, mode=[2])):
                            if pred[0, 0, i]:
                                sx = sx + tXrX[None, 0, i].load().to(Float32).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            row_max = block_reduce(m, fmax, buf_max, Float32(-FLT_MAX))
            row_sum = block_reduce(s * cute.math.exp2((m - row_max) * LOG2E, fastmath=True), fadd, buf_sum, Float32(0.0))
            row_sx = Float32(0.0)
            if const_expr(self.smooth):
                row_sx = block_reduce(sx, fadd, buf_sx, Float32(0.0))
            loss = Float32(0.0)
            lse = Float32(0.0)
            if valid:
                lse = row_max + cute.math.log2(row_sum) * LN2
                xt = Float32(0.0)
                if in_range:
                    xt = Float32(mX[row, t])
                loss = lse - (Float32(1.0) - smoothing) * xt
                if const_expr(self.smooth):
                    loss = loss - smoothing * (row_sx / Float32(self.v))
            if bad:
                loss = Float32(float("nan"))
            if tidx == 0:
                mLoss[row] = loss
                mLse[row] = lse
        else:
            lse = mLse[row]
            scale = Float32(0.0)
            if const_expr(self.per_row):
                scale = mScale[row]
            else:
                scale = mScale[0]
            if bad:
                scale = Float32(float("nan"))
            eps = smoothing / Float32(self.v)
            tXrD = cute.make_rmem_tensor_like(thr.partition_D(cute.local_tile(mDX, tile, (row, 0))))
            if valid:
                for c in cutlass.range(self.chunks, unroll=1):
                    tXgX = thr.partition_S(cute.local_tile(mX, tile, (row, c)))
                    tXgD = thr.partition_D(cute.local_tile(mDX, tile, (row, c)))
                    pred = col_pred(thr.partition_S(cute.local_tile(ident, tile, (row, c))), self.v)
                    tXrX.fill(0.0)
                    cute.copy(tiled_copy, tXgX, tXrX, pred=pred)
                    p = cute.math.exp2((tXrX.load().to(Float32) - lse) * LOG2E, fastmath=True) - eps
                    tXrD.store((p * scale).to(self.dtype))
                    cute.copy(tiled_copy, tXrD, tXgD, pred=pred)
                if in_range:
                    # the thread that stored the target's vector fixes its column (same thread:
                    # program order puts this store after that one)
                    owner = Int32(((t % self.chunk) // self.vec) % self.threads)
                    if tidx == owner:
                        xt = Float32(mX[row, t])
                        g = cute.math.exp2((xt - lse) * LOG2E, fastmath=True) - eps - (Float32(1.0) - smoothing)
                        mDX[row, t] = (g * scale).to(self.dtype)
            else:
                tXrD.fill(0.0)
                for c in cutlass.range(self.chunks, unroll=1):
                    tXgD = thr.partition_D(cute.local_tile(mDX, tile, (row, c)))
                    pred = col_pred(thr.partition_S(cute.local_tile(ident, tile, (row, c))), self.v)
                    cute.copy(tiled_copy, tXrD, tXgD, pred=pred)


def _fake(dtype, *shape, align: int):
    return cute.runtime.make_fake_compact_tensor(dtype, shape, stride_order=tuple(reversed(range(len(shape)))), assumed_align=align)


@functools.cache
def compile_ce(dtype: str, v: int, tdtype: str, grad: bool, smooth: bool, per_row: bool):
    """Compiled pass for one key: ``f(x2, t, loss, lse, dx, scale, ignore_index, smoothing)``.

    x2 and dx are row-major ``[M, V]`` at 16-byte aligned addresses; t, loss, lse ``[M]``; scale
    contiguous fp32, ``[1]`` or ``[M]`` (``per_row``). The forward writes loss and lse (dx, scale
    unused); the backward reads lse and scale and writes dx (loss unused). M is dynamic: one
    compile serves every row count.
    """
    dt, m, k = DTYPES[dtype], cute.sym_int(), cute.sym_int()
    # x2 and dx by a runtime int64 row stride, not the static V of a compact layout: with a
    # static stride CuTeDSL computes row * V + column in 32 bits (PTX mad.lo.s32), which wraps
    # past 2^32 elements (bf16 V = 128256: row 33488 on) and reads and writes an earlier row
    return cute.compile(
        _CrossEntropy(dt, v, TDTYPES[tdtype], grad, smooth, per_row),
        fake_rows(dt, m, v),
        _fake(TDTYPES[tdtype], m, align=4),
        _fake(Float32, m, align=4),
        _fake(Float32, m, align=4),
        fake_rows(dt, m, v),
        _fake(Float32, k, align=4),
        Int64(-100),
        Float32(0.0),
        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
        options="--enable-tvm-ffi",
    )
