"""PyTorch fused add + RMSNorm: ``x + residual``, then the torch ``rms_norm`` impl (two passes)."""

from __future__ import annotations

import torch

from .rms_norm import rms_norm


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float
) -> tuple[torch.Tensor, torch.Tensor]:
    s = x + residual
    return rms_norm(s, weight, eps, offset, "fp32"), s
