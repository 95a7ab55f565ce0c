"""Liger-Kernel cross-entropy on ``loss.cross_entropy``'s signature.

Liger's ``LigerCrossEntropyFunction`` breaks two points of the contract: it rounds the per-row
losses to the logits' dtype (a bf16 loss), and it writes the gradient into the logits. So this
adapter launches Liger's own kernel (``liger_cross_entropy_kernel``, the whole of Liger's
computation) with an fp32 loss buffer and a private copy of the logits to hold the gradient,
the copy made only when a gradient is needed (without one, Liger's kernel writes nothing).
Like Liger, it syncs with the host once per call (the count of non-ignored targets): not
capturable in a CUDA graph. A "mean" over no target is NaN, as in PyTorch (Liger's is 0).
Class weights, softcap and z_loss go to Liger's kernel (``HAS_WEIGHT``, ``HAS_SOFTCAPPING``,
``lse_square_scale``); Liger's z-loss is not weighted by ``w[t]`` and a weighted mean divides it
by the count rather than the summed weights, so the predicate (``_gates.cross_entropy``) excludes
weight and z_loss together.
"""

from __future__ import annotations

import torch
import triton
from liger_kernel.ops.cross_entropy import MAX_FUSED_SIZE, liger_cross_entropy_kernel

from .._cross_entropy import scale_grads_
from .._double_backward import refusing
from .._fallback import registered

# what this impl does not take goes to the torch impl, resolved by name on first use (polykernel.backends._fallback)
_torch_cross_entropy = registered("loss.cross_entropy")


def _num_warps(x: torch.Tensor) -> int:
    # liger_kernel/ops/cross_entropy.py: 8 for 16-bit logits on Blackwell, else 32 (CUDA)
    try:
        from liger_kernel.utils import infer_device_arch

        blackwell = infer_device_arch().startswith("blackwell")
    except Exception:
        blackwell = False
    return 8 if (x.element_size() == 2 and blackwell) else 32


def loss_rows(
    x: torch.Tensor,
    t: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    reduction: str,
    grad: bool,
    weight: torch.Tensor | None = None,
    softcap: float | None = None,
    z_loss: float = 0.0,
):
    """Per-row fp32 losses (divided by the count, or the summed weights, for "mean") and, when
    ``grad``, dloss/dx in a new tensor (the gradient of the reduced loss w.r.t. x for an upstream
    gradient of 1). Returns (losses, dx, the mean's divisor)."""
    rows, v = x.shape
    work = x.clone(memory_format=torch.contiguous_format) if grad else (x if x.stride(-1) == 1 else x.contiguous())
    t = t.contiguous()
    count = int((t != ignore_index).sum().item())
    wsum, w_total = float(count), 0.0
    if weight is not None:
        weight = weight.to(torch.float32).contiguous()
        wsum = float(weight[t[t != ignore_index].long()].sum().item())
        w_total = float(weight.sum().item())
    loss = torch.zeros(rows, dtype=torch.float32, device=x.device)
    liger_cross_entropy_kernel[(rows,)](
        X_ptr=work,
        X_stride=work.stride(-2),
        Y_ptr=t,
        Y_stride=t.stride(-1),
        weight_ptr=weight,
        loss_ptr=loss,
        z_loss_ptr=None,
        loss_stride=loss.stride(-1),
        token_accuracy_ptr=None,
        token_accuracy_stride=0,
        predicted_tokens_ptr=None,
        predicted_tokens_stride=0,
        n_cols=v,
        n_non_ignore=count,
        sum_non_ignore_weight=wsum,
        weight_sum=w_total,
        ignore_index=ignore_index,
        lse_square_scale=float(z_loss),
        label_smoothing=label_smoothing,
        reduction=reduction,
        softcap=softcap,
        RETURN_Z_LOSS=False,
        RETURN_TOKEN_ACCURACY=False,
        RETURN_PREDICTED_TOKENS=False,
        BLOCK_SIZE=min(MAX_FUSED_SIZE, triton.next_power_of_2(v)),
        HAS_WEIGHT=weight is not None,
        HAS_SOFTCAPPING=softcap is not None,
        HAS_GRADIENTS=grad,
        num_warps=_num_warps(x),
    )
    return loss, (work if grad else None), wsum


class _LigerCrossEntropyPlain(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ignore_index, label_smoothing, reduction, weight, softcap, z_loss):  # type: ignore[override]
        v = logits.shape[-1]
        grad = ctx.needs_input_grad[0]
        args = (ignore_index, label_smoothing, reduction, grad, weight, softcap, z_loss)
        loss, dx, count = loss_rows(logits.reshape(-1, v), target.reshape(-1), *args)
        ctx.save_for_backward(dx)
        ctx.shape, ctx.reduction = logits.shape, reduction
        if reduction == "none":  # not a view: a Function's view output cannot be edited in place
            return loss.view(target.shape).detach()
        out = loss.sum()
        if reduction == "mean" and count == 0:
            out = out + float("nan")  # PyTorch: a mean over no target is NaN (the gradient stays 0)
        return out

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        (dx,) = ctx.saved_tensors
        # dx is ours (a private copy): scale it in place, with the fp32 upstream gradient
        if ctx.reduction == "none":
            dx.mul_(g.reshape(-1, 1))
        else:
            scale_grads_(g, dx)
        return dx.view(ctx.shape), None, None, None, None, None, None, None


# create_graph=True: second derivatives raise, naming the op, instead of reading zeros (refusing())
_LigerCrossEntropy = refusing(_LigerCrossEntropyPlain, "loss.cross_entropy", "liger", (0,), kept=False)


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
    # weighted mean over weights summing to 0: Liger's gradient would be 0/0 (PyTorch's NaN loss
    # has zero gradients); and weight with z_loss differs (module docstring): torch's then
    zero_wsum = weight is not None and reduction == "mean" and not bool(_scored_weight(weight, target, ignore_index))
    if logits.numel() == 0 or zero_wsum or (weight is not None and z_loss):
        return _torch_cross_entropy(logits, target, ignore_index, label_smoothing, reduction, weight, softcap, z_loss)
    return _LigerCrossEntropy.apply(logits, target, ignore_index, float(label_smoothing), reduction, weight, softcap, float(z_loss))


def _scored_weight(weight: torch.Tensor, target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    t = target.reshape(-1)
    return weight[t[t != ignore_index].long()].sum()
