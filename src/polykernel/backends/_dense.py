"""Layouts the serving peers' kernels take (FlashInfer, sgl-kernel): contiguous rows whose data
pointer is 16-byte aligned. Their kernels trust the pointers they are handed (16-byte vector loads,
no stride arguments for most), so the adapters give them only such tensors: a contiguous, aligned
view as is, anything else as a fresh copy (read-only arguments) or through a fresh buffer copied
back (outputs). A fresh allocation is aligned (the caching allocator's blocks are 512-byte aligned).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

ALIGN = 16  # bytes: one 128-bit vector

# FlashInfer's CUDA norm kernels (include/flashinfer/norm.cuh: RMSNormKernel, FusedAddRMSNormKernel,
# RMSNormQuantKernel; sgl-kernel compiles the same file) find a row at ``bx * stride_input``, both
# uint32: past 2**32 elements the offset wraps and the kernel reads and writes other rows of the
# same buffer (no fault: silently wrong rows). :func:`uint32_parts` hands them such tensors in
# slices of rows that each stay below it.
UINT32_ELEMS = 1 << 32
PART_ROWS = 16  # a slice starts a multiple of 16 rows in: 16-byte aligned for any n, fp8 included
MAX_PART_N = UINT32_ELEMS // PART_ROWS  # longer rows cannot be sliced so (the gates refuse them)


def dense(t: torch.Tensor) -> bool:
    """Whether ``t`` is contiguous with a 16-byte aligned data pointer (what the kernels read)."""
    return t.is_contiguous() and t.data_ptr() % ALIGN == 0


def uint32_parts(*ts: torch.Tensor) -> Iterator[tuple[torch.Tensor, ...]]:
    """Dense ``[rows, n]`` tensors of one shape, whole when they hold at most 2**32 elements (the
    usual case: one launch), else as views of the same rows, at most 2**32 elements each and
    starting at multiples of :data:`PART_ROWS` rows (so each view keeps the 16-byte alignment;
    writes through them reach the tensors). For kernels that address rows in uint32
    (:data:`UINT32_ELEMS`); n must not exceed :data:`MAX_PART_N`."""
    m, n = ts[0].shape
    if m * n <= UINT32_ELEMS:
        yield ts
        return
    assert n <= MAX_PART_N, n
    step = UINT32_ELEMS // n // PART_ROWS * PART_ROWS
    for i in range(0, m, step):
        yield tuple(t[i : i + step] for t in ts)


def vectors(t: torch.Tensor) -> bool:
    """Whether 16-byte vectors may be loaded from ``t`` at any multiple of 16 bytes into a run of
    its last dim: unit last stride, a 16-byte aligned data pointer, and every other stride (of a
    dim longer than one) a multiple of 16 bytes. For kernels that take strides but load vectors."""
    step = ALIGN // t.element_size()
    return t.stride(-1) == 1 and t.data_ptr() % ALIGN == 0 and all(s % step == 0 for s, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1)


def readable(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when dense, else a dense copy (for arguments the kernel only reads)."""
    return t if dense(t) else t.clone(memory_format=torch.contiguous_format)


def rows(t: torch.Tensor, n: int) -> torch.Tensor | None:
    """``[rows, n]`` view of ``t`` when dense (writes through it reach ``t``), else None."""
    return t.view(-1, n) if dense(t) else None


def writable(out: torch.Tensor) -> torch.Tensor:
    """Where a kernel may write ``out``: ``out`` itself when dense, else a fresh buffer of its
    shape that :func:`settle` copies back."""
    return out if dense(out) else torch.empty(out.shape, dtype=out.dtype, device=out.device)


def settle(out: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    """``out`` holding what the kernel wrote into ``buf`` (see :func:`writable`)."""
    return out if buf is out else out.copy_(buf)
