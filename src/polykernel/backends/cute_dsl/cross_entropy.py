"""CuTeDSL cross-entropy (``loss.cross_entropy``): forward and backward, sm_90+.

Kernel in :mod:`._ce_kernel` (one CTA per row, online softmax over V in 128-bit chunks); this
file holds the host launchers and the registered impl. Two schedules, as in the Triton impl:

* ``GRAD_IN_FORWARD = True`` (mean/sum reductions, caller needs grad): one launch in the forward
  computes the loss and writes dlogits for ``grad_output = 1`` (the row's second read mostly
  hits L2); the backward scales it by the real grad_output in place, skipped when that is exactly
  1 (one sync; always scaled during CUDA-graph capture).
* otherwise the forward writes loss and LSE, and the backward re-reads the logits with the saved
  LSE and writes the scaled gradient (``reduction="none"`` always: its grad_output is per row).

Which is faster on the H200 is for ``benchmarks/bench_cute_dsl.py`` to say (it times both).
"""

from __future__ import annotations

import torch

from ..torch.cross_entropy import grad_scale, reduce_rows, scale_grads_
from . import _ce_kernel as kern

GRAD_IN_FORWARD = True  # see the module docstring


def _rows16(t: torch.Tensor, v: int) -> torch.Tensor:
    """``t`` as a row-major ``[n, V]`` tensor at a 16-byte aligned address (copies if needed)."""
    t2 = t.reshape(-1, v)
    if not t2.is_contiguous() or t2.data_ptr() % 16:
        t2 = t2.contiguous()
    return t2


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _launch(x2, t, loss, lse, dx, scale, ignore_index: int, ls: float, fwd: bool, grad: bool) -> None:
    n, v = x2.shape
    if not n:
        return
    per_row = grad and scale.numel() > 1
    f = kern.compile_ce(_name(x2.dtype), v, _name(t.dtype), fwd, grad, ls > 0, per_row)
    f(x2, t, loss, lse, dx if grad else x2, scale.reshape(-1) if grad else lse, ignore_index, float(ls))


def ce_forward(x2, t, ignore_index: int, ls: float, dx=None, scale=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row fp32 loss and LSE of row-major ``x2 [n, V]``; with ``dx`` and ``scale`` (fp32,
    one value or ``[n]``) also writes the scaled gradient in the same launch."""
    n = x2.shape[0]
    loss = torch.empty(n, dtype=torch.float32, device=x2.device)
    lse = torch.empty(n, dtype=torch.float32, device=x2.device)
    _launch(x2, t, loss, lse, dx, scale, ignore_index, ls, True, dx is not None)
    return loss, lse


def ce_backward(x2, t, lse, scale, ignore_index: int, ls: float) -> torch.Tensor:
    """The scaled gradient ``[n, V]`` in x2's dtype, from x2 and the saved LSE."""
    dx = torch.empty_like(x2)
    _launch(x2, t, lse, lse, dx, scale, ignore_index, ls, False, True)
    return dx


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ignore_index, ls, reduction):  # type: ignore[override]
        x2 = _rows16(logits, logits.shape[-1])
        t = target.reshape(-1).contiguous()
        count = (t != ignore_index).sum()
        ctx.ignore_index, ctx.ls, ctx.reduction, ctx.shape = ignore_index, ls, reduction, logits.shape
        ctx.grad_in_forward = GRAD_IN_FORWARD and reduction != "none"
        if ctx.grad_in_forward:
            one = torch.ones((), dtype=torch.float32, device=x2.device)
            dx = torch.empty_like(x2)
            loss, _ = ce_forward(x2, t, ignore_index, ls, dx, grad_scale(one, count, reduction, torch.float32))
            ctx.dx = dx
        else:
            loss, lse = ce_forward(x2, t, ignore_index, ls)
            ctx.save_for_backward(x2, t, lse, count)
        return reduce_rows(loss, count, reduction, target.shape)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        if ctx.grad_in_forward:
            dx, ctx.dx = ctx.dx, None
            if dx is None:
                raise RuntimeError("polykernel cross_entropy (cute_dsl): backward ran twice; the gradient was consumed")
            scale_grads_(g, dx)
        else:
            x2, t, lse, count = ctx.saved_tensors
            dx = ce_backward(x2, t, lse, grad_scale(g, count, ctx.reduction, torch.float32), ctx.ignore_index, ctx.ls)
        return dx.view(ctx.shape), None, None, None, None


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, label_smoothing: float, reduction: str) -> torch.Tensor:
    """The registered impl (arguments validated by ``polykernel.cross_entropy``; V admitted by
    the predicate).

    >>> loss = cross_entropy(torch.randn(8, 128256, device="cuda"), torch.zeros(8, dtype=torch.long, device="cuda"), -100, 0.0, "mean")  # doctest: +SKIP
    """
    if torch.is_grad_enabled() and logits.requires_grad:
        return _CrossEntropy.apply(logits, target, ignore_index, label_smoothing, reduction)
    t = target.reshape(-1).contiguous()
    loss, _ = ce_forward(_rows16(logits, logits.shape[-1]), t, ignore_index, label_smoothing)
    return reduce_rows(loss, (t != ignore_index).sum(), reduction, target.shape)
