"""``torch.mm`` for the torch impls' chunked backward GEMMs (``dH = dZ @ W``), with a slow CPU case
taken around.

On a CPU without AVX512-BF16 (torch 2.13, AVX2), torch's bf16/fp16 GEMM is tens of times slower
when both operands have the same layout (both row-major, as ``dZ`` and ``W`` are) than when they
differ; the fused linear cross-entropy's backward at the README quickstart's shape spent most of
its time there (benchmarks/results/cpu-2026-12-07-twentyninth/, ``benchmarks/host/cpu_gemm_layouts.py``).
So the smaller operand is copied to the other layout first: a copy of at most one chunk's
``[rows, V]`` gradient, never of the head. (fp16 is fastest with the right operand column-major,
which would copy the head: the left one's copy still takes most of the time off.) Elsewhere (CUDA,
fp32, mixed layouts) it is ``torch.mm`` as it is.
"""

from __future__ import annotations

import torch

_HALF = (torch.bfloat16, torch.float16)


def _row_major(t: torch.Tensor) -> bool:
    return t.stride(1) == 1


def operands(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a, b)`` as :func:`mm` hands them to ``torch.mm``: on a CPU in half precision, of two layouts."""
    if a.device.type != "cpu" or a.dtype not in _HALF or _row_major(a) != _row_major(b):
        return a, b
    small_a = a.numel() <= b.numel()
    x = a if small_a else b
    x = x.t().contiguous().t() if _row_major(x) else x.contiguous()
    return (x, b) if small_a else (a, x)


def mm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.mm(a, b, out=out)``, without torch's slow same-layout case on a CPU in half precision.

    >>> a, b = torch.ones(2, 3, dtype=torch.bfloat16), torch.ones(3, 4, dtype=torch.bfloat16)
    >>> mm(a, b).tolist()[0]
    [3.0, 3.0, 3.0, 3.0]
    """
    return torch.mm(*operands(a, b), out=out)
