"""cuda_jit fused_add_rms_norm (forward): ``s = x + residual`` and ``rms_norm(s)`` in one pass
(``csrc/rms_norm.cuh``, ADD); fresh outputs. Registered without a backward."""

from __future__ import annotations

import torch

from . import _host


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return _host.fused_add_rms_norm(x, residual, weight, eps, offset)
