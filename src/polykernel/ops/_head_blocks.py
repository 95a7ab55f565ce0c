"""An LM head's rows (its classes) in float64, a block at a time: how the float64 references and
error models of the fused linear losses read a ``[V, H]`` head without a float64 copy of it (at
128256 x 4096 that is 4.2 GB, and the first-call check made several: the H200, 2026-12-04)."""

from __future__ import annotations

from collections.abc import Iterator

import torch


def float64_blocks(
    weight: torch.Tensor, bias: torch.Tensor | None, block: int
) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor | None]]:
    """``(start, end, weight rows, bias rows)`` in float64, ``block`` rows at a time; always
    copies (a caller may write into them), detached."""
    for s in range(0, weight.shape[0], block):
        e = min(s + block, weight.shape[0])
        w = weight[s:e].detach().to(torch.float64, copy=True)
        yield s, e, w, None if bias is None else bias[s:e].detach().to(torch.float64, copy=True)
