"""CuTeDSL cross-entropy (``loss.cross_entropy``): forward and backward, sm_90+.

Kernel in :mod:`._ce_kernel` (one CTA per row, online softmax over V in 128-bit chunks); this
file holds the host launchers and the registered impl. The forward writes each row's fp32 loss
and LSE; the backward re-reads the logits with the saved LSE and writes
``(softmax - smoothed one-hot) · grad_output · scale`` computed in fp32 and rounded once at the
store. (A schedule that wrote dlogits in the forward was removed: two roundings and 3.5x slower
on the H200; see :mod:`._ce_kernel`.)

CuTeDSL is imported on the first launch, so this module imports on any machine.
"""

from __future__ import annotations

from types import ModuleType

import torch

from .._cross_entropy import differentiable, grad_scale, reduce_rows
from .._double_backward import graph_grads
from .._fallback import registered
from .softmax import _rows16  # the same row-major, 16-byte aligned rows

# what this impl does not take goes to the torch impl, resolved by name on first use (polykernel.backends._fallback)
_torch_cross_entropy = registered("loss.cross_entropy")


def _kernel() -> ModuleType:
    from . import _ce_kernel  # CuTeDSL: only once a launch needs it

    return _ce_kernel


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def ce_forward(x2: torch.Tensor, t: torch.Tensor, ignore_index: int, ls: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row fp32 loss and LSE of row-major ``x2 [n, V]`` (``t``: contiguous ``[n]`` targets)."""
    n, v = x2.shape
    loss = torch.empty(n, dtype=torch.float32, device=x2.device)
    lse = torch.empty(n, dtype=torch.float32, device=x2.device)
    if n:
        f = _kernel().compile_ce(_name(x2.dtype), v, _name(t.dtype), False, ls > 0, False)
        f(x2, t, loss, lse, x2, lse, ignore_index, float(ls))  # dx, scale: unused by the forward
    return loss, lse


def ce_backward(x2: torch.Tensor, t: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor, ignore_index: int, ls: float) -> torch.Tensor:
    """The gradient ``[n, V]`` in x2's dtype, from x2, the saved LSE and the fp32 ``scale`` (a 0-d
    tensor or one value per row: grad_output, divided by the valid count for "mean")."""
    n, v = x2.shape
    dx = torch.empty_like(x2)
    if n:
        # contiguous: a "none" grad_output is often an expanded scalar (stride 0), and the kernel
        # was compiled for unit stride
        scale = scale.reshape(-1).contiguous()
        per_row = scale.numel() > 1
        f = _kernel().compile_ce(_name(x2.dtype), v, _name(t.dtype), True, ls > 0, per_row)
        f(x2, t, lse, lse, dx, scale, ignore_index, float(ls))  # loss: unused by the backward
    return dx


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ignore_index, ls, reduction):  # type: ignore[override]
        x2 = _rows16(logits, logits.shape[-1])
        t = target.reshape(-1).contiguous()
        count = (t != ignore_index).sum()
        loss, lse = ce_forward(x2, t, ignore_index, ls)
        ctx.ignore_index, ctx.ls, ctx.reduction, ctx.shape = ignore_index, ls, reduction, logits.shape
        ctx.save_for_backward(x2, t, lse, count, logits)  # logits: a create_graph backward differentiates through it
        return reduce_rows(loss, count, reduction, target.shape)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        x2, t, lse, count, logits = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: differentiable gradients, by the torch formula
            target = t.view(g.shape) if ctx.reduction == "none" else t
            args = (logits, target, ctx.ignore_index, ctx.ls, ctx.reduction)
            return graph_grads(differentiable, args, (g,), (True, False, False, False, False))[0], None, None, None, None
        dx = ce_backward(x2, t, lse, grad_scale(g, count, ctx.reduction, torch.float32), ctx.ignore_index, ctx.ls)
        return dx.view(ctx.shape), None, None, None, None


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    reduction: str,
    weight: torch.Tensor | None = None,
    softcap: float | None = None,
    z_loss: float = 0.0,
) -> torch.Tensor:
    """The registered impl (arguments validated by ``polykernel.cross_entropy``; V admitted by
    the predicate, which excludes the options weight, softcap and z_loss).

    >>> loss = cross_entropy(torch.randn(8, 128256, device="cuda"), torch.zeros(8, dtype=torch.long, device="cuda"), -100, 0.0, "mean")  # doctest: +SKIP
    """
    if weight is not None or softcap is not None or z_loss:  # never ignore an option: a direct call gets torch's
        return _torch_cross_entropy(logits, target, ignore_index, label_smoothing, reduction, weight, softcap, z_loss)
    if torch.is_grad_enabled() and logits.requires_grad:
        return _CrossEntropy.apply(logits, target, ignore_index, label_smoothing, reduction)
    t = target.reshape(-1).contiguous()
    loss, _ = ce_forward(_rows16(logits, logits.shape[-1]), t, ignore_index, label_smoothing)
    return reduce_rows(loss, (t != ignore_index).sum(), reduction, target.shape)
