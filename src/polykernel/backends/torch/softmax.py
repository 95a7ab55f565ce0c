"""PyTorch softmax: ``torch.softmax`` over the last dim.

PyTorch's kernels accumulate in fp32 for bf16/fp16 inputs and return the input dtype, which is
the op's forward contract. Its backward, though, uses the saved output in the input dtype, whose
rounding leaks into ``Σ dy·y``; for bf16/fp16 this Function saves x instead and recomputes the
fp32 y in the backward (``_softmax_backward_data`` in fp32), as the contract's fp32 math says.
"""

from __future__ import annotations

import torch


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        ctx.save_for_backward(x)
        return torch.softmax(x, dim=-1)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        y = torch.softmax(x.float(), dim=-1)
        return torch._softmax_backward_data(dy.float(), y, -1, torch.float32).to(x.dtype)


def softmax(x: torch.Tensor) -> torch.Tensor:
    if x.dtype in (torch.float32, torch.float64) or not (torch.is_grad_enabled() and x.requires_grad):
        return torch.softmax(x, dim=-1)
    return _Softmax.apply(x)
