"""Triton fused linear cross-entropy: the shared row-chunk driver with the Triton CE kernel.

Per chunk the logits come from a torch matmul (cuBLAS); one launch of the cross-entropy kernel
(FWD+GRAD) reads each row twice and writes the scaled dlogits over the logits in place, so the
chunk buffer is the only N-proportional temporary. Gradient matmuls as in the driver
(``polykernel.backends._fused_linear_cross_entropy``); the backward's cotangent multiply
reads the cotangent on the device under CUDA-graph capture (``_scale``).
"""

from __future__ import annotations

import torch

from ...ops.fused_linear_cross_entropy import reference  # noqa: F401  (semantics live in the op file)
from .._cross_entropy import Extras, extras
from .._fused_linear_cross_entropy import make_split, run
from ._scale import scale_grads_
from .cross_entropy import ce_forward


def _chunk(x: torch.Tensor, t: torch.Tensor, ignore_index: int, ls: float, scale: torch.Tensor | None, ex: Extras) -> torch.Tensor:
    # the options (weight, softcap, z_loss) are the CE kernel's constexpr flags, fused in the same launch
    loss, _ = ce_forward(x, t, ignore_index, ls, grad=x if scale is not None else None, scale=scale, ex=ex)
    return loss


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    reduction: str,
    ce_weight: torch.Tensor | None = None,
    softcap: float | None = None,
    z_loss: float = 0.0,
) -> torch.Tensor:
    """The registered impl (arguments already validated by ``polykernel.fused_linear_cross_entropy``)."""
    ex = extras(ce_weight, softcap, z_loss)
    return run(hidden, weight, target, bias, ignore_index, label_smoothing, reduction, _chunk, scale_grads_, "triton", ex)


fused_linear_cross_entropy.split = make_split(_chunk)  # type: ignore[attr-defined]  # compiled graphs: no recompute
