"""PyTorch fused linear cross-entropy: the chunked driver (:mod:`polykernel.backends._fused_linear_cross_entropy`)
with the row-chunked torch cross-entropy per chunk."""

from __future__ import annotations

import torch

from ...ops.fused_linear_cross_entropy import reference  # noqa: F401  (semantics live in the op file)
from .._cross_entropy import Extras, extras, loss_and_grad
from .._fused_linear_cross_entropy import make_split, run

# ---------------------------------------------------------------------------------------------
# Registered impl


def _chunk(x: torch.Tensor, t: torch.Tensor, ignore_index: int, ls: float, scale: torch.Tensor | None, ex: Extras) -> torch.Tensor:
    loss, _ = loss_and_grad(x, t, ignore_index, ls, scale, out=None if scale is None else x, ex=ex)
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
    return run(hidden, weight, target, bias, ignore_index, label_smoothing, reduction, _chunk, ex=ex)


fused_linear_cross_entropy.split = make_split(_chunk)  # type: ignore[attr-defined]
