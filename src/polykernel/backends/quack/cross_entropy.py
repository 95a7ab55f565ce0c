"""QuACK cross-entropy (``quack.cross_entropy.cross_entropy``, CuTeDSL) on ``loss.cross_entropy``.

fp32 losses; ``ignore_index`` and every reduction; no label smoothing (the predicate excludes
it). A "mean" over no target is 0/0 = NaN, as in PyTorch. The logits are not written to
(``inplace_backward=False``).
"""

from __future__ import annotations

import torch
from quack.cross_entropy import cross_entropy as _quack_cross_entropy

from .._fallback import registered
from ._rows import rows

# what this impl does not take goes to the torch impl, resolved by name on first use (polykernel.backends._fallback)
_torch_cross_entropy = registered("loss.cross_entropy")


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
    # the predicate excludes the options; a direct call with one still gets the right answer
    if logits.numel() == 0 or label_smoothing or weight is not None or softcap is not None or z_loss:
        return _torch_cross_entropy(logits, target, ignore_index, label_smoothing, reduction, weight, softcap, z_loss)
    v = logits.shape[-1]
    # QuACK compiles for a unit-stride target: a stepped view (labels[::2]) would be read as dense
    loss = _quack_cross_entropy(rows(logits, v), target.reshape(-1).contiguous(), ignore_index=ignore_index, reduction=reduction)
    return loss.view(target.shape) if reduction == "none" else loss
