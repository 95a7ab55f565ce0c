"""Host helpers shared by the row-wise Triton kernels (norms): tile shapes, SM count, [M, N] views.

Each kernel file keeps its own ``TUNE`` settings; these helpers only turn settings into shapes.
"""

from __future__ import annotations

import functools
import math

import torch
import triton.language as tl

TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def cdiv(a: int, b: int) -> int:
    """``triton.cdiv`` in plain Python. Triton's is a ``ConstexprFunction``: ~4 µs a call on the
    host (dev CPU), and the norms call it twice or three times per fwd+bwd.

    >>> cdiv(16384, 8), cdiv(5, 4)
    (2048, 2)
    """
    return (a + b - 1) // b


def next_pow2(n: int) -> int:
    """``triton.next_power_of_2`` in plain Python (~6 µs a call there; 0 for 0, like Triton's).

    >>> next_pow2(4000), next_pow2(1), next_pow2(0)
    (4096, 1, 0)
    """
    return 1 << (n - 1).bit_length() if n > 0 else 0


@functools.lru_cache(maxsize=4096)  # host time: the same few (n, settings) on every call
def row_tile(n: int, elems: int, warps: int | None) -> tuple[int, int, int]:
    """(BLOCK_N, ROWS, num_warps) for rows that fit one block: about ``elems`` elements per program.

    Default warps by tile size: within 1% of the best setting swept at 16384x4096
    (benchmarks/kernels/sweep_rms_norm.py; notes/PERF.md, 2026-11-29).
    """
    block_n = next_pow2(max(n, 1))
    rows = max(1, min(32, elems // block_n))
    if warps is None:
        warps = 4 if block_n * rows <= 2048 else 8 if block_n <= 4096 else 16
    return block_n, rows, warps


@functools.cache
def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device; 2 on the CPU interpreter (still several partial rows)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2


def as_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """A [M, N] view with unit column stride (copies only when the layout needs it).

    A 2-D tensor with unit column stride is returned as it is: no view op on the host path."""
    if t.dim() != 2:
        t = t.reshape(math.prod(t.shape[:-1]), n)  # not -1: ambiguous when N = 0
    return t if t.stride(-1) == 1 or t.numel() == 0 else t.contiguous()


def contig(t: torch.Tensor) -> torch.Tensor:
    """``t.contiguous()`` without the op call when ``t`` already is (the usual weight)."""
    return t if t.is_contiguous() else t.contiguous()


def unrows(t2: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The [M, N] result ``t2`` in the input's ``shape`` (no view op when that is 2-D already)."""
    return t2 if len(shape) == 2 else t2.view(shape)
