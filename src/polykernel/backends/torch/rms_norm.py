"""PyTorch RMSNorm: ``F.rms_norm`` (PyTorch's fused kernel) where its semantics match ours."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...ops.rms_norm import reference


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, casting: str) -> torch.Tensor:
    # F.rms_norm upcasts to fp32, multiplies by the weight in fp32 and casts once: our "fp32"
    # casting, when the weight has x's dtype (with another dtype its output dtype differs) and
    # there is no offset (weight + offset in bf16 would round Gemma's 1 + w before the multiply).
    if casting == "fp32" and offset == 0.0 and weight.dtype == x.dtype and x.dtype != torch.float64:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return reference(x, weight, eps, offset, casting)
