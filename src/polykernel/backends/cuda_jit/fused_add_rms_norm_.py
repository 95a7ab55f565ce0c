"""cuda_jit fused_add_rms_norm_ (serving, in place): the fused kernel writing s over residual and
y over x (each element read before its thread writes it); a layout the 128-bit vectors cannot
take is computed into fresh rows and copied back. No allocation otherwise: CUDA-graph safe."""

from __future__ import annotations

import torch

from . import _host


def fused_add_rms_norm_(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return _host.fused_add_rms_norm(x, residual, weight, eps, offset, in_place=True)
