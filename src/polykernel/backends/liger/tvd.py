"""Liger-Kernel total variation distance (``LigerTVDLossFunction``) on ``loss.tvd``'s signature.

Liger takes ``[BT, V]`` rows and its reductions are the contract's; its loss is fp32. It counts
the scored rows on the host (one sync per call: not capturable in a CUDA graph) and divides by
that count in Python, so an all-ignored batch would raise ZeroDivisionError there: this adapter
gives the contract's NaN (means) or 0 (sum) through the torch impl instead. It has no gradient
for q (the predicate refuses a q that needs one).
"""

from __future__ import annotations

import torch
from liger_kernel.ops.tvd import LigerTVDLossFunction

from ...ops._distill import rows_view
from .._double_backward import refusing
from .._fallback import registered

# what this impl does not take goes to the torch impl, resolved by name on first use (polykernel.backends._fallback)
_torch_tvd = registered("loss.tvd")

# create_graph=True: second derivatives raise, naming the op, instead of reading zeros (refusing())
_TVDLoss = refusing(LigerTVDLossFunction, "loss.tvd", "liger", (0,), kept=False)


def tvd(p: torch.Tensor, q: torch.Tensor, labels: torch.Tensor | None, reduction: str, ignore_index: int) -> torch.Tensor:
    lab = None if labels is None else labels.reshape(-1)
    if p.numel() == 0 or (lab is not None and not bool((lab != ignore_index).any())):
        return _torch_tvd(p, q, labels, reduction, ignore_index)
    out = _TVDLoss.apply(rows_view(p), rows_view(q), lab, reduction, ignore_index)
    return out.view(p.shape) if reduction == "none" else out
