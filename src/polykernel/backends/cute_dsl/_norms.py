"""CuTeDSL row-norm kernels shared by ``rms_norm`` and ``layer_norm`` (torch-free: the host
launchers and autograd live in :mod:`.rms_norm` and :mod:`.layer_norm`).

Forward: a CTA (or a cluster of CTAs, for rows past 16K elements) holds its rows in registers,
loaded once with 16-byte vectors; the row statistics come from :func:`._common.row_sum` and y is
written from the same registers, so x is read once (2 bytes moved per element and dtype byte).
LayerNorm centres in registers before squaring (two-pass variance: no E[x²] - E[x]² cancellation).

Backward: a persistent grid of ``groups`` CTA groups walks row blocks ``g, g + groups, ...``;
each keeps its share of dW (and dB) in registers - or, for the widest rows, in shared memory - and
writes it to its own row of an fp32 partial buffer that the host sums (no atomics: deterministic).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from ._common import (
    MAX_THREADS,
    RowConfig,
    cluster_done,
    compile_kernel,
    fake_rows,
    fake_vector,
    reduction_buffers,
    row_config,
    row_sum,
    tiled_copy,
)

FWD_ELEMS = 32  # x stays in registers: 32 fp32 values per thread
BWD_ELEMS = 16  # x, dy, dW (and dB) in registers
BWD_WIDE_ELEMS = 32  # rows wider than BWD_ELEMS allows: x, dy in registers, dW/dB in shared memory


@cute.jit
def _copy_in_bounds(
    copy: cute.TiledCopy | None,
    src: cute.Tensor,
    dst: cute.Tensor,
    coords: cute.Tensor,
    m: Int32,
    n: Int32,
    vecs: cutlass.Constexpr[int],
    check_rows: cutlass.Constexpr[bool] = True,
):
    """Copy the in-bounds vectors of a thread's partition (others keep dst's value). ``copy`` is
    x's tiled copy (one 16-byte vector each), or None for another dtype (parameters, fp32
    partials: partitioned by x's layout, moved with whatever vector width autovec finds)."""
    for k in cutlass.range_constexpr(vecs):
        c = coords[0, 0, k]
        if c[1] < n:
            if const_expr(check_rows):
                if c[0] < m:
                    _copy_vec(copy, src[None, None, k], dst[None, None, k])
            else:
                _copy_vec(copy, src[None, None, k], dst[None, None, k])


@cute.jit
def _copy_vec(copy: cute.TiledCopy | None, src: cute.Tensor, dst: cute.Tensor):
    if const_expr(copy is None):
        cute.autovec_copy(src, dst)
    else:
        cute.copy(copy, src, dst)


@cute.jit
def _zero_outside(frag: cute.Tensor, coords: cute.Tensor, n: Int32, vecs: cutlass.Constexpr[int]):
    """Zero the vectors of a register fragment that lie past column n (padding of the last CTA)."""
    for k in cutlass.range_constexpr(vecs):
        if coords[0, 0, k][1] >= n:
            frag[None, None, k].fill(0.0)


def _rows_view(vec: cute.Tensor, m: Int32, n: int) -> cute.Tensor:
    """A 1-D [n] parameter seen as [m, n] with row stride 0 (every row reads the same vector)."""
    return cute.make_tensor(vec.iterator, cute.make_layout((m, n), stride=(0, 1)))


class NormFwd:
    """y = x̂·(w + offset) [+ b], x̂ = x·rstd (RMS) or (x - mean)·rstd (LayerNorm).

    Specialised on dtypes, N, ``layer`` (LayerNorm), ``llama`` (round x̂ to x's dtype before the
    weight multiply) and which parameters exist; eps and offset are runtime scalars.
    """

    def __init__(self, dtype, w_dtype, b_dtype, n: int, cfg: RowConfig, layer: bool, llama: bool):
        self.dtype, self.w_dtype, self.b_dtype = dtype, w_dtype, b_dtype
        self.n, self.cfg, self.layer, self.llama = n, cfg, layer, llama

    def smem_bytes(self) -> int:
        return 4 * 2 * (self.cfg.rows * self.cfg.warps_per_row + 1) + 256

    @cute.jit
    def __call__(self, mX, mW, mB, mY, mRstd, mMean, eps: Float32, offset: Float32, stream):
        cfg = self.cfg
        grid_m = cute.ceil_div(mX.shape[0], cfg.rows)
        self.kernel(mX, mW, mB, mY, mRstd, mMean, eps, offset).launch(
            grid=[grid_m, cfg.cluster, 1],
            block=[cfg.threads, 1, 1],
            cluster=[1, cfg.cluster, 1] if const_expr(cfg.cluster > 1) else None,
            smem=self.smem_bytes(),
            stream=stream,
        )

    @cute.kernel
    def kernel(self, mX, mW, mB, mY, mRstd, mMean, eps: Float32, offset: Float32):
        cfg, n = self.cfg, self.n
        tiler = (cfg.rows, cfg.tile_n)
        tidx, _, _ = cute.arch.thread_idx()
        bidx, cidx, _ = cute.arch.block_idx()
        m = mX.shape[0]

        smem = cutlass.utils.SmemAllocator()
        block, peer = reduction_buffers(smem, cfg, 2)

        copy_x = tiled_copy(self.dtype, cfg)
        thr = copy_x.get_slice(tidx)
        tXgX = thr.partition_S(cute.local_tile(mX, tiler, (bidx, cidx)))
        tXgY = thr.partition_D(cute.local_tile(mY, tiler, (bidx, cidx)))
        tXcX = thr.partition_S(cute.local_tile(cute.make_identity_tensor(mX.shape), tiler, (bidx, cidx)))
        tXrX = cute.make_fragment_like(tXgX)
        tXrX.fill(0.0)
        _copy_in_bounds(copy_x, tXgX, tXrX, tXcX, m, n, cfg.vecs)

        # Parameters: issue their loads before the reductions so they overlap the shuffles.
        tWrW = None
        if const_expr(mW is not None):
            tWgW = thr.partition_S(cute.local_tile(_rows_view(mW, m, n), tiler, (bidx, cidx)))
            tWrW = cute.make_fragment_like(tWgW)
            tWrW.fill(0.0)
            _copy_in_bounds(self._param_copy(self.w_dtype, copy_x), tWgW, tWrW, tXcX, m, n, cfg.vecs, False)
        tBrB = None
        if const_expr(mB is not None):
            tBgB = thr.partition_S(cute.local_tile(_rows_view(mB, m, n), tiler, (bidx, cidx)))
            tBrB = cute.make_fragment_like(tBgB)
            tBrB.fill(0.0)
            _copy_in_bounds(self._param_copy(self.b_dtype, copy_x), tBgB, tBrB, tXcX, m, n, cfg.vecs, False)

        x = tXrX.load().to(Float32)
        mean = Float32(0.0)
        if const_expr(self.layer):
            mean = row_sum(x.reduce(cute.ReductionOp.ADD, Float32(0.0), 0), block, peer, Int32(0), cfg.threads_per_row, cfg.cluster) / n
            tXrC = cute.make_fragment_like(tXrX, Float32)
            tXrC.store(x - mean)
            _zero_outside(tXrC, tXcX, n, cfg.vecs)  # padding must not add (0 - mean)² to the variance
            x = tXrC.load()
        ss = row_sum((x * x).reduce(cute.ReductionOp.ADD, Float32(0.0), 0), block, peer, Int32(1), cfg.threads_per_row, cfg.cluster)
        rstd = cute.math.rsqrt(ss / n + eps)

        row = tXcX[0, 0, 0][0]
        if tidx % cfg.threads_per_row == 0 and cidx == 0 and row < m:
            mRstd[row] = rstd
            if const_expr(self.layer):
                mMean[row] = mean

        xhat = x * rstd
        if const_expr(self.llama):
            xhat = xhat.to(self.dtype).to(Float32)
        y = xhat
        if const_expr(mW is not None):
            y = y * (tWrW.load().to(Float32) + offset)
        if const_expr(mB is not None):
            y = y + tBrB.load().to(Float32)
        tXrY = cute.make_fragment_like(tXgY)
        tXrY.store(y.to(self.dtype))
        _copy_in_bounds(copy_x, tXrY, tXgY, tXcX, m, n, cfg.vecs)
        cluster_done(cfg.cluster)

    def _param_copy(self, dtype, copy_x):
        return copy_x if dtype == self.dtype else None


class NormBwd:
    """dx, and per-group partials of dW = Σ dy·x̂ and dB = Σ dy ([groups·rows, N] fp32).

    RMS: dx = rstd·(g - x̂·mean(g·x̂)); LayerNorm: dx = rstd·(g - mean(g) - x̂·mean(g·x̂)), with
    g = dy·(w + offset) (dy without a weight). ``llama`` rounds x̂ in dW and g to x's dtype, as the
    reference's casts do.
    """

    def __init__(self, dtype, w_dtype, n: int, cfg: RowConfig, layer: bool, llama: bool, has_b: bool, acc_smem: bool):
        self.dtype, self.w_dtype, self.n, self.cfg = dtype, w_dtype, n, cfg
        self.layer, self.llama, self.has_b, self.acc_smem = layer, llama, has_b, acc_smem

    def smem_bytes(self) -> int:
        cfg = self.cfg
        acc = 0
        if self.acc_smem:
            accs = (1 if self.w_dtype is not None else 0) + (1 if self.has_b else 0)
            acc = accs * cfg.rows * cfg.tile_n * 4 + 128 * accs
        return acc + 4 * 4 * (cfg.rows * cfg.warps_per_row + 1) + 256

    @cute.jit
    def __call__(self, mX, mW, mDY, mRstd, mMean, mDX, mDW, mDB, offset: Float32, groups: Int32, stream):
        cfg = self.cfg
        self.kernel(mX, mW, mDY, mRstd, mMean, mDX, mDW, mDB, offset, groups).launch(
            grid=[groups, cfg.cluster, 1],
            block=[cfg.threads, 1, 1],
            cluster=[1, cfg.cluster, 1] if const_expr(cfg.cluster > 1) else None,
            smem=self.smem_bytes(),
            stream=stream,
        )

    @cute.jit
    def _accumulator(self, smem, like: cute.Tensor, thr, tiler):
        if const_expr(self.acc_smem):
            s = smem.allocate_tensor(Float32, cute.make_ordered_layout(tiler, order=(1, 0)), byte_alignment=16)
            acc = thr.partition_D(s)
        else:
            acc = cute.make_fragment_like(like, Float32)
        acc.fill(0.0)  # each thread zeroes (and later reads) only its own elements: no barrier
        return acc

    @cute.kernel
    def kernel(self, mX, mW, mDY, mRstd, mMean, mDX, mDW, mDB, offset: Float32, groups: Int32):
        cfg, n = self.cfg, self.n
        tiler = (cfg.rows, cfg.tile_n)
        tidx, _, _ = cute.arch.thread_idx()
        bidx, cidx, _ = cute.arch.block_idx()
        m = mX.shape[0]

        smem = cutlass.utils.SmemAllocator()
        block, peer = reduction_buffers(smem, cfg, 4)
        copy_x = tiled_copy(self.dtype, cfg)
        thr = copy_x.get_slice(tidx)

        # The weight slice is the same for every row: load it once. (A variant that re-reads it per
        # row on the wide path cut ptxas' spill from 144 B to 12 B and measured faster for
        # layer_norm 4096x16384 fwd+bwd; it was reverted because its parity was never run on the
        # GPU. Re-apply it with a parity run: commit b25e13a.)
        tWrW = None
        if const_expr(mW is not None):
            tWgW = thr.partition_S(cute.local_tile(_rows_view(mW, m, n), tiler, (0, cidx)))
            tWcW = thr.partition_S(cute.local_tile(cute.make_identity_tensor(mX.shape), tiler, (0, cidx)))
            tWrW = cute.make_fragment_like(tWgW)
            tWrW.fill(0.0)
            _copy_in_bounds(copy_x if const_expr(self.w_dtype == self.dtype) else None, tWgW, tWrW, tWcW, m, n, cfg.vecs, False)

        probe = thr.partition_S(cute.local_tile(mX, tiler, (0, cidx)))
        tDW = None
        if const_expr(mDW is not None):
            tDW = self._accumulator(smem, probe, thr, tiler)
        tDB = None
        if const_expr(mDB is not None):
            tDB = self._accumulator(smem, probe, thr, tiler)

        ident = cute.make_identity_tensor(mX.shape)
        for rb in cutlass.range(bidx, cute.ceil_div(m, cfg.rows), groups, unroll=1):
            slot = ((rb - bidx) // groups % 2) * 2  # alternate slot pairs between iterations
            tXgX = thr.partition_S(cute.local_tile(mX, tiler, (rb, cidx)))
            tXgDY = thr.partition_S(cute.local_tile(mDY, tiler, (rb, cidx)))
            tXgDX = thr.partition_D(cute.local_tile(mDX, tiler, (rb, cidx)))
            tXcX = thr.partition_S(cute.local_tile(ident, tiler, (rb, cidx)))
            tXrX = cute.make_fragment_like(tXgX)
            tXrDY = cute.make_fragment_like(tXgDY)
            tXrX.fill(0.0)
            tXrDY.fill(0.0)
            _copy_in_bounds(copy_x, tXgX, tXrX, tXcX, m, n, cfg.vecs)
            _copy_in_bounds(copy_x, tXgDY, tXrDY, tXcX, m, n, cfg.vecs)
            row = tXcX[0, 0, 0][0]
            rstd = Float32(0.0)
            mean = Float32(0.0)
            if row < m:
                rstd = mRstd[row]
                if const_expr(self.layer):
                    mean = mMean[row]

            x = tXrX.load().to(Float32)
            dy = tXrDY.load().to(Float32)
            xhat = (x - mean) * rstd if const_expr(self.layer) else x * rstd
            g = dy
            if const_expr(mW is not None):
                g = dy * (tWrW.load().to(Float32) + offset)
            xhat_w = xhat
            if const_expr(self.llama):  # y = round(x̂)·w: the reference's cast also rounds the gradient of x̂
                xhat_w = xhat.to(self.dtype).to(Float32)
                g = g.to(self.dtype).to(Float32)
            # Padding: dy = 0 there, so g and g·x̂ vanish although x̂ = -mean·rstd need not.
            c1 = row_sum((g * xhat).reduce(cute.ReductionOp.ADD, Float32(0.0), 0), block, peer, slot, cfg.threads_per_row, cfg.cluster) / n
            dx = g - xhat * c1
            if const_expr(self.layer):
                c2 = row_sum(g.reduce(cute.ReductionOp.ADD, Float32(0.0), 0), block, peer, slot + 1, cfg.threads_per_row, cfg.cluster) / n
                dx = dx - c2
            tXrDX = cute.make_fragment_like(tXgDX)
            tXrDX.store((dx * rstd).to(self.dtype))
            _copy_in_bounds(copy_x, tXrDX, tXgDX, tXcX, m, n, cfg.vecs)
            if const_expr(mDW is not None):
                tDW.store(tDW.load() + dy * xhat_w)
            if const_expr(mDB is not None):
                tDB.store(tDB.load() + dy)

        # Partials: CTA group bidx owns rows [bidx·rows, (bidx+1)·rows) of the [groups·rows, N] buffers.
        if const_expr(mDW is not None):
            self._write_partial(tDW, mDW, tiler, bidx, cidx)
        if const_expr(mDB is not None):
            self._write_partial(tDB, mDB, tiler, bidx, cidx)
        cluster_done(cfg.cluster)

    @cute.jit
    def _write_partial(self, acc, mP, tiler, bidx, cidx):
        tidx, _, _ = cute.arch.thread_idx()
        thr = tiled_copy(self.dtype, self.cfg).get_slice(tidx)
        coords = thr.partition_S(cute.local_tile(cute.make_identity_tensor(mP.shape), tiler, (bidx, cidx)))
        tPgP = thr.partition_D(cute.local_tile(mP, tiler, (bidx, cidx)))
        tPrP = cute.make_fragment_like(tPgP)
        tPrP.store(acc.load())
        _copy_in_bounds(None, tPrP, tPgP, coords, mP.shape[0], self.n, self.cfg.vecs)


# -- compile (once per key; the row count is symbolic) ---------------------------------------------


def fwd_config(n: int, elem_bits: int) -> RowConfig:
    return row_config(n, elem_bits, FWD_ELEMS)


def bwd_config(n: int, elem_bits: int) -> tuple[RowConfig, bool]:
    """(tiling, dW/dB accumulate in shared memory): registers while a CTA row fits BWD_ELEMS."""
    vec = 128 // elem_bits
    if -(-n // vec) <= MAX_THREADS * max(1, BWD_ELEMS // vec):  # one CTA per row in registers
        return row_config(n, elem_bits, BWD_ELEMS), False
    return row_config(n, elem_bits, BWD_WIDE_ELEMS), True


def compile_fwd(dtype, w_dtype, b_dtype, n: int, layer: bool, llama: bool):
    """Compile the forward for (dtypes, N, options); called through ``_common.compiled``."""
    cfg = fwd_config(n, dtype.width)
    m = cute.sym_int()
    kernel = NormFwd(dtype, w_dtype, b_dtype, n, cfg, layer, llama)
    return compile_kernel(
        kernel,
        fake_rows(dtype, m, n),
        fake_vector(w_dtype, n),
        fake_vector(b_dtype, n),
        fake_rows(dtype, m, n),
        fake_vector(Float32, m, 4),
        fake_vector(Float32, m, 4) if layer else None,
        Float32(0.0),
        Float32(0.0),
    )


def compile_bwd(dtype, w_dtype, n: int, layer: bool, llama: bool, want_dw: bool, want_db: bool):
    """Compile the backward; the partial buffers have a symbolic row count (groups x rows)."""
    cfg, acc_smem = bwd_config(n, dtype.width)
    m, parts = cute.sym_int(), cute.sym_int()
    kernel = NormBwd(dtype, w_dtype if want_dw or w_dtype is not None else None, n, cfg, layer, llama, want_db, acc_smem)
    return compile_kernel(
        kernel,
        fake_rows(dtype, m, n),
        fake_vector(w_dtype, n),
        fake_rows(dtype, m, n),
        fake_vector(Float32, m, 4),
        fake_vector(Float32, m, 4) if layer else None,
        fake_rows(dtype, m, n),
        fake_rows(Float32, parts, n) if want_dw else None,
        fake_rows(Float32, parts, n) if want_db else None,
        Float32(0.0),
        Int32(1),
    )
