"""CuTeDSL softmax (``activation.softmax``): forward and backward, N <= 32768, sm_90+.

Kernels in :mod:`._softmax_kernel` (one CTA per row, the row in registers, 128-bit accesses);
this file holds the host launchers and the registered impl. The forward saves each row's fp32
(max, 1/sum) and the input; the backward recomputes y in fp32 from them (the contract's fp32
gradient, same bytes as reading a saved y). The impl's predicate (:mod:`._predicates`) admits
N a multiple of 16 bytes up to 32768; the kernels compile once per (dtype, N) and are cached.
CuTeDSL is imported on the first launch, so this module imports on any machine.
"""

from __future__ import annotations

import math
from types import ModuleType

import torch

from ...ops.softmax import reference
from .._double_backward import graph_grads


def _kernel() -> ModuleType:
    from . import _softmax_kernel  # CuTeDSL: only once a launch needs it

    return _softmax_kernel


def _rows16(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t`` as a row-major ``[M, n]`` tensor at a 16-byte aligned address (copies if needed)."""
    t2 = t.reshape(math.prod(t.shape[:-1]), n)
    if not t2.is_contiguous() or t2.data_ptr() % 16:
        t2 = t2.contiguous()
    return t2


def softmax_forward(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """y ``[M, N]`` in x's dtype and each row's fp32 (max, 1/sum), from row-major ``x2``."""
    m, n = x2.shape
    y = torch.empty_like(x2)
    rmax = torch.empty(m, dtype=torch.float32, device=x2.device)
    rinv = torch.empty(m, dtype=torch.float32, device=x2.device)
    if m:
        _kernel().compile_forward(str(x2.dtype).removeprefix("torch."), n)(x2, y, rmax, rinv)
    return y, rmax, rinv


def softmax_backward(dy2: torch.Tensor, x2: torch.Tensor, rmax: torch.Tensor, rinv: torch.Tensor) -> torch.Tensor:
    """dx ``[M, N]`` in x's dtype: ``y·(dy - Σ y·dy)`` with y recomputed from x and the row stats."""
    m, n = x2.shape
    dx = torch.empty_like(x2)
    if m:
        _kernel().compile_backward(str(x2.dtype).removeprefix("torch."), n)(x2, dy2, rmax, rinv, dx)
    return dx


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        x2 = _rows16(x, x.shape[-1])
        y, rmax, rinv = softmax_forward(x2)
        ctx.save_for_backward(x2, rmax, rinv, x)  # x: a create_graph backward differentiates through it
        ctx.shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x2, rmax, rinv, x = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: differentiable gradients, by the torch formula
            return graph_grads(reference, (x,), (dy,), (True,))[0]
        dy2 = _rows16(dy.to(x2.dtype), x2.shape[1])
        return softmax_backward(dy2, x2, rmax, rinv).view(ctx.shape)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """The registered impl (arguments validated by ``polykernel.softmax``, N admitted by the predicate).

    >>> y = softmax(torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16))  # doctest: +SKIP
    """
    if torch.is_grad_enabled() and x.requires_grad:
        return _Softmax.apply(x)
    return softmax_forward(_rows16(x, x.shape[-1]))[0].view(x.shape)
