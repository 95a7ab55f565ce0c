"""PyTorch LayerNorm: ``F.layer_norm`` (PyTorch's fused kernel) where its semantics match ours."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...ops.layer_norm import reference

# PyTorch's CPU backward for bf16/fp16 builds dW from low-precision intermediates (measured: 0.64
# off on a bf16 dW of 8.7 when mean(x) = 40); there, the fp32 reference is the accurate choice.
_CPU_NATIVE = (torch.float32, torch.float64)


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    # F.layer_norm computes the statistics and the affine step in fp32 (opmath) and casts once:
    # our semantics, when the parameters have x's dtype (with another dtype, its CPU and CUDA
    # kernels differ in what they accept and return) and the row is not empty.
    if (
        all(p is None or p.dtype == x.dtype for p in (weight, bias))
        and x.shape[-1] > 0
        and (x.device.type != "cpu" or x.dtype in _CPU_NATIVE)
    ):
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    return reference(x, weight, bias, eps)
