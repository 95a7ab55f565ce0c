"""PyTorch fused_add_rms_norm_ (in place): the training op's torch impl, copied over the inputs."""

from __future__ import annotations

import torch

from .fused_add_rms_norm import fused_add_rms_norm


def fused_add_rms_norm_(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float
) -> tuple[torch.Tensor, torch.Tensor]:
    y, s = fused_add_rms_norm(x, residual, weight, eps, offset)  # both fresh: x and residual are read in full first
    residual.copy_(s)
    x.copy_(y)
    return x, residual
