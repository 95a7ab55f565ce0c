"""QuACK cross-entropy (``quack.cross_entropy.cross_entropy``, CuTeDSL) on ``loss.cross_entropy``.

fp32 losses; ``ignore_index`` and every reduction; no label smoothing (the predicate excludes
it). A "mean" over no target is 0/0 = NaN, as in PyTorch. The logits are not written to
(``inplace_backward=False``).
"""

from __future__ import annotations

import torch
from quack.cross_entropy import cross_entropy as _quack_cross_entropy

from ..torch.cross_entropy import cross_entropy as _torch_cross_entropy
from ._rows import rows


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, label_smoothing: float, reduction: str) -> torch.Tensor:
    if logits.numel() == 0 or label_smoothing:
        return _torch_cross_entropy(logits, target, ignore_index, label_smoothing, reduction)
    v = logits.shape[-1]
    loss = _quack_cross_entropy(rows(logits, v), target.reshape(-1), ignore_index=ignore_index, reduction=reduction)
    return loss.view(target.shape) if reduction == "none" else loss
