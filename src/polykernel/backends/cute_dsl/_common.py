"""Shared by the ``cute_dsl`` kernels: row tiling, 128-bit tiled copies, warp / block / cluster
row reductions, the compile cache and the launch path. Imports ``cutlass`` (so it is loaded only
when a ``cute_dsl`` impl is selected), never torch at import time (CPU compile checks run in an
environment without torch).

Launch path: every kernel is compiled once per key with ``cute.compile(..., options=
"--enable-tvm-ffi")`` on fake tensors whose row count is symbolic, so one compile serves every M;
a call hands torch tensors straight to the compiled function (TVM-FFI reads pointers, shapes and
the current torch stream, so CUDA-graph capture works) - no per-call DLPack wrapping.

Row kernels all use one layout: a CTA owns ``rows`` rows x ``tile_n`` columns; a row is spread
over ``threads_per_row`` threads, each holding ``vecs`` 16-byte vectors, vector ``k`` of thread
``t`` at column ``(k * threads_per_row + t) * vec`` (consecutive threads, consecutive 16 bytes:
coalesced). Rows longer than one CTA are split across a cluster of ``cluster`` CTAs whose partial
sums meet through distributed shared memory.

>>> cfg = row_config(4096, 16)  # bf16, N = 4096: one row per 128-thread CTA, 4 vectors a thread
>>> (cfg.rows, cfg.threads_per_row, cfg.vecs, cfg.cluster)
(1, 128, 4, 1)
"""

from __future__ import annotations

import math
import operator
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import llvm, nvvm
from cutlass.cutlass_dsl import dsl_user_op

from ._gates import MAX_NORM_N, VEC_BYTES

WARP = 32
MAX_CLUSTER = 16  # sm_90 allows 16 CTAs per cluster with the non-portable attribute CuTeDSL sets
MAX_THREADS = 512
ARCH_OPTION = "--enable-tvm-ffi"

# torch dtype names -> CuTeDSL element types (names, so that this module stays torch-free)
DTYPES = {"float32": cutlass.Float32, "bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}


def cutlass_dtype(dtype: Any) -> type[cutlass.Numeric]:
    """The CuTeDSL element type of a torch dtype (or its name)."""
    return DTYPES[str(dtype).removeprefix("torch.")]


# -- row tiling (host side, plain Python) ---------------------------------------------------------


@dataclass(frozen=True)
class RowConfig:
    """How a [M, N] row kernel tiles its input (see the module docstring)."""

    vec: int  # elements per 16-byte vector
    threads_per_row: int
    threads: int  # per CTA
    rows: int  # rows per CTA
    vecs: int  # vectors per thread per row
    cluster: int  # CTAs per row

    @property
    def tile_n(self) -> int:
        """Columns one CTA covers (the last CTA of a row may run past N: predicated)."""
        return self.threads_per_row * self.vecs * self.vec

    @property
    def warps_per_row(self) -> int:
        return max(1, self.threads_per_row // WARP)


def _pow2(x: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(x, 1))))


def row_config(n: int, elem_bits: int, max_elems: int = 32, min_threads: int = 128) -> RowConfig:
    """Tile rows of ``n`` elements of ``elem_bits`` bits with at most ``max_elems`` elements per
    thread (they live in registers: 32 fp32 values for the forward, fewer where a kernel keeps
    more per element). Short rows share a CTA; a row wider than ``MAX_THREADS`` threads gets a
    cluster. Raises ValueError past what one cluster holds (``_gates.MAX_NORM_N`` at 32)."""
    vec = VEC_BYTES * 8 // elem_bits
    nv = max(1, -(-n // vec))
    kmax = max(1, max_elems // vec)
    tpr = _pow2(-(-nv // kmax))
    cluster = 1
    if tpr > MAX_THREADS:
        tpr = MAX_THREADS
        cluster = -(-nv // (tpr * kmax))
        if cluster > MAX_CLUSTER:
            raise ValueError(f"N = {n} needs {cluster} CTAs per row; a cluster holds {MAX_CLUSTER}")
    vecs = -(-nv // (tpr * cluster))
    threads = max(tpr, min_threads)
    return RowConfig(vec=vec, threads_per_row=tpr, threads=threads, rows=threads // tpr, vecs=vecs, cluster=cluster)


assert row_config(MAX_NORM_N, 32).cluster <= MAX_CLUSTER  # the gate's limit is what fits


# -- compile cache ----------------------------------------------------------------------------------

_compiled: dict[tuple, Any] = {}
_compile_lock = threading.Lock()
compile_count = 0  # how many compiles ran (tests: a key never compiles twice)


def compiled(key: tuple, build: Callable[[], Any]) -> Any:
    """The compiled kernel for ``key``, built by ``build()`` on the first call only.

    The key holds everything the kernel is specialised on (kernel kind, dtypes, N, options,
    arch); the row count is symbolic, so it is not part of it. Compiles are serialized: two
    threads meeting a new key compile it once.
    """
    fn = _compiled.get(key)
    if fn is None:
        global compile_count
        with _compile_lock:
            fn = _compiled.get(key)
            if fn is None:
                fn = build()
                compile_count += 1
                _compiled[key] = fn
    return fn


def fake_rows(dtype: type[cutlass.Numeric] | None, m: Any, n: int) -> Any:
    """A fake [m, n] row-major tensor for compiling: symbolic m and row stride, 16-byte aligned
    (the host launcher guarantees it: see ``_norm_host.rows16``)."""
    if dtype is None:
        return None
    vec = VEC_BYTES * 8 // dtype.width
    stride = cute.sym_int64(divisibility=vec)
    return cute.runtime.make_fake_tensor(dtype, (m, n), stride=(stride, 1), assumed_align=VEC_BYTES)


def fake_vector(dtype: type[cutlass.Numeric] | None, n: Any, align: int = VEC_BYTES) -> Any:
    """A fake contiguous 1-D tensor (weights, per-row statistics)."""
    if dtype is None:
        return None
    return cute.runtime.make_fake_compact_tensor(dtype, (n,), assumed_align=align)


def compile_kernel(kernel: Any, *args: Any) -> Any:
    """``cute.compile`` with the TVM-FFI calling convention and the env stream as last argument."""
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(kernel, *args, stream, options=ARCH_OPTION)


# -- device-side helpers --------------------------------------------------------------------------


def tiled_copy(dtype: type[cutlass.Numeric], cfg: RowConfig) -> Any:
    """A tiled copy moving ``cfg.vec`` elements of ``dtype`` per thread (one 16-byte vector for x's
    dtype; a wider parameter dtype takes two) over a ``(rows, threads_per_row)`` thread grid."""
    bits = min(128, cfg.vec * dtype.width)
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=bits)
    thr = cute.make_ordered_layout((cfg.rows, cfg.threads_per_row), order=(1, 0))
    val = cute.make_layout((1, cfg.vec))
    return cute.make_tiled_copy_tv(atom, thr, val)


def reduction_smem_bytes(cfg: RowConfig, slots: int) -> int:
    """Shared memory of :func:`row_sum`'s buffers (block partials and the cluster slot)."""
    return 4 * slots * (cfg.rows * cfg.warps_per_row + 1) + 64


def reduction_buffers(smem: Any, cfg: RowConfig, slots: int) -> tuple[Any, Any]:
    """Shared-memory buffers of :func:`row_sum`: block partials ``(slots, rows, warps_per_row)``
    and the cluster slots ``(slots,)``. A slot may be rewritten once one more barrier has passed
    since it was read, so a kernel alternates at least two."""
    block = smem.allocate_tensor(
        Float32, cute.make_ordered_layout((slots, cfg.rows, cfg.warps_per_row), order=(2, 1, 0)), byte_alignment=16
    )
    peer = smem.allocate_tensor(Float32, cute.make_layout(slots), byte_alignment=16)
    return block, peer


@dsl_user_op
def load_peer_f32(smem_ptr: cute.Pointer, rank: Int32, *, loc: Any = None, ip: Any = None) -> Float32:
    """Read an fp32 at the same shared-memory offset in cluster peer ``rank`` (distributed shared
    memory: ``mapa`` into the shared::cluster window, then ``ld.shared::cluster``)."""
    cluster_space = llvm.PointerType.get(7)  # shared::cluster
    local = smem_ptr.to_llvm_ptr(loc=loc, ip=ip)
    remote = nvvm.mapa(cluster_space, local, Int32(rank).ir_value(loc=loc, ip=ip), loc=loc, ip=ip)
    return Float32(llvm.load(Float32.mlir_type, remote, loc=loc, ip=ip))


@cute.jit
def row_sum(
    val: Float32,
    block: cute.Tensor,
    peer: cute.Tensor,
    slot: Int32,
    threads_per_row: cutlass.Constexpr[int],
    cluster: cutlass.Constexpr[int],
) -> Float32:
    """Sum ``val`` over the threads of this thread's row (every thread gets the result).

    Warp shuffles (a butterfly: every lane ends with bitwise the same sum), then the warps of a
    row through shared memory, then - for rows split over a cluster - the CTAs' partials through
    distributed shared memory: each CTA publishes its partial in its own slot, a cluster barrier
    (release/acquire) makes them visible, and every warp reads all peers in rank order, so every
    CTA computes the identical total (deterministic, and the same statistics on every slice).
    """
    val = cute.arch.warp_reduction(val, operator.add, threads_in_group=min(threads_per_row, WARP))
    if const_expr(threads_per_row > WARP):
        warps_per_row = threads_per_row // WARP
        lane, warp = cute.arch.lane_idx(), cute.arch.warp_idx()
        r, j = warp // warps_per_row, warp % warps_per_row
        if lane == 0:
            block[slot, r, j] = val
        cute.arch.barrier()
        val = block[slot, r, 0]
        for i in cutlass.range_constexpr(1, warps_per_row):
            val = val + block[slot, r, i]
    if const_expr(cluster > 1):
        tidx, _, _ = cute.arch.thread_idx()
        if tidx == 0:
            peer[slot] = val
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
        lane = cute.arch.lane_idx()
        part = Float32(0.0)
        if lane < cluster:
            part = load_peer_f32(peer.iterator + slot, lane)
        val = cute.arch.warp_reduction(part, operator.add)
    return val


@cute.jit
def cluster_done(cluster: cutlass.Constexpr[int]) -> None:
    """Last barrier of a clustered kernel: no CTA exits while a peer may still read its slots."""
    if const_expr(cluster > 1):
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
