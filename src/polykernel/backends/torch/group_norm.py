"""PyTorch GroupNorm: ``F.group_norm`` (PyTorch's fused kernel) where its semantics match ours."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ...ops.group_norm import reference

# PyTorch's CPU kernels for bf16/fp16 keep low-precision intermediates (as its layer_norm does,
# see backends/torch/layer_norm.py): there, the fp32 reference is the accurate choice.
_CPU_NATIVE = (torch.float32, torch.float64)


def _native(x: torch.Tensor, num_groups: int, weight: torch.Tensor | None, bias: torch.Tensor | None) -> bool:
    """Whether F.group_norm computes our semantics for these arguments."""
    return (
        # parameters in x's dtype (its CPU kernel refuses others; mixed dtypes differ by device)
        all(p is None or p.dtype == x.dtype for p in (weight, bias))
        and (x.device.type != "cpu" or x.dtype in _CPU_NATIVE)
        and x.numel() > 0  # its backward of an empty x gives NaN parameter gradients
        # it refuses N·C/G·S = 1 ("more than 1 value per channel"), where ours gives the bias
        and x.shape[0] * x.shape[1] // num_groups * math.prod(x.shape[2:]) > 1
        and not (weight is None and bias is not None)  # its CPU backward fails on a bias without weight
    )


def group_norm(x: torch.Tensor, num_groups: int, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    # F.group_norm computes the statistics and the affine step in fp32 (opmath) and casts once.
    if _native(x, num_groups, weight, bias):
        return F.group_norm(x, num_groups, weight, bias, eps)
    return reference(x, num_groups, weight, bias, eps)
