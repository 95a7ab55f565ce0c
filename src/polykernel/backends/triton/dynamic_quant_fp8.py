"""Triton dynamic_quant_fp8: the per-token and per-tensor kernels of :mod:`.quant_fp8`."""

from __future__ import annotations

import torch

from .quant_fp8 import dynamic_quant


def dynamic_quant_fp8(
    x: torch.Tensor, per_token: bool = True, q: torch.Tensor | None = None, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The registered impl (arguments validated and outputs allocated by ``polykernel.dynamic_quant_fp8``)."""
    if q is None:
        q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    if scale is None:
        scale = torch.empty((*x.shape[:-1], 1) if per_token else (1,), dtype=torch.float32, device=x.device)
    return dynamic_quant(x, per_token, q, scale)
