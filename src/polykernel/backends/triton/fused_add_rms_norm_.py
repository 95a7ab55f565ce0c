"""Triton fused_add_rms_norm_ (serving layout, in place): the training op's forward kernel with
its outputs pointed at its inputs.

:func:`polykernel.backends.triton.fused_add_rms_norm.forward_into` launches the forward kernel
with y = x and s = residual (each through its own row stride): each program loads its rows before
it stores them, and for rows longer than one block the chunked walk reads the stored s back
instead of re-adding. One launch, no allocation, no rstd: CUDA-graph safe. x or residual with no
[M, N] row view (a transposed view) is computed into temporaries and copied back. Contiguous
x, residual and weight launch from C++ when the native path is on (the out-of-place op's plans).
"""

from __future__ import annotations

import torch

from . import _native
from ._rows import contig as _contig
from .fused_add_rms_norm import _native_plan, forward_into, fused_add_rms_norm_forward
from .glu import _row_view


def fused_add_rms_norm_(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The registered impl (arguments already validated by ``polykernel.fused_add_rms_norm_``)."""
    if _native.ENABLED:
        args = (x, residual, weight, eps, offset)
        if _native.call("fused_add_rms_norm_inplace", args, args[:3], _native_plan) is not None:
            return x, residual
    n = x.shape[-1]
    if x.numel() == 0:
        return x, residual
    w = _contig(weight)
    x2, r2 = _row_view(x, n), _row_view(residual, n)
    if x2 is not None and r2 is not None:
        forward_into(x2, r2, w, x2, r2, None, eps, offset)
        return x, residual
    y, s, _ = fused_add_rms_norm_forward(
        x.reshape(-1, n).contiguous(), residual.reshape(-1, n).contiguous(), w, eps, offset, need_rstd=False
    )
    residual.copy_(s.view(residual.shape))
    x.copy_(y.view(x.shape))
    return x, residual
