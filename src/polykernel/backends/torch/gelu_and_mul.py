"""PyTorch gelu_and_mul: the reference's fp32 math, written into the given ``out``."""

from __future__ import annotations

import torch

from ...ops.gelu_and_mul import reference


def gelu_and_mul(x: torch.Tensor, approximate: str = "none", out: torch.Tensor | None = None) -> torch.Tensor:
    return reference(x, approximate, out)
