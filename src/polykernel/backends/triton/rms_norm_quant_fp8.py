"""Triton rms_norm_quant_fp8: RMSNorm and static fp8 quantisation in one kernel (:mod:`.quant_fp8`)."""

from __future__ import annotations

import torch

from .quant_fp8 import rms_norm_quant


def rms_norm_quant_fp8(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6, q: torch.Tensor | None = None
) -> torch.Tensor:
    """The registered impl (arguments validated and q allocated by ``polykernel.rms_norm_quant_fp8``)."""
    return rms_norm_quant(x, weight, scale, eps, q if q is not None else torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device))
