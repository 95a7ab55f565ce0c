"""PyTorch rms_norm_quant_fp8: the op's reference (fp32 RMSNorm, then the quantiser), into q."""

from __future__ import annotations

import torch

from ...ops.rms_norm_quant_fp8 import reference


def rms_norm_quant_fp8(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6, q: torch.Tensor | None = None
) -> torch.Tensor:
    return reference(x, weight, scale, eps, q)
