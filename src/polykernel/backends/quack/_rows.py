"""Shared by the QuACK adapters: QuACK's kernels take 2-D row-major tensors."""

from __future__ import annotations

import torch


def rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t`` as contiguous ``[rows, n]`` (a view when it already is one, else a copy)."""
    t2 = t.reshape(-1, n)
    return t2 if t2.is_contiguous() else t2.contiguous()
