"""PyTorch dynamic_quant_fp8: the op's reference, written into the given q and scale."""

from __future__ import annotations

import torch

from ...ops.dynamic_quant_fp8 import reference


def dynamic_quant_fp8(
    x: torch.Tensor, per_token: bool = True, q: torch.Tensor | None = None, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    return reference(x, per_token, q, scale)
