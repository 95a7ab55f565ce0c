"""Layouts the serving peers' kernels take (FlashInfer, sgl-kernel): contiguous rows whose data
pointer is 16-byte aligned. Their kernels trust the pointers they are handed (16-byte vector loads,
no stride arguments for most), so the adapters give them only such tensors: a contiguous, aligned
view as is, anything else as a fresh copy (read-only arguments) or through a fresh buffer copied
back (outputs). A fresh allocation is aligned (the caching allocator's blocks are 512-byte aligned).
"""

from __future__ import annotations

import torch

ALIGN = 16  # bytes: one 128-bit vector


def dense(t: torch.Tensor) -> bool:
    """Whether ``t`` is contiguous with a 16-byte aligned data pointer (what the kernels read)."""
    return t.is_contiguous() and t.data_ptr() % ALIGN == 0


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
