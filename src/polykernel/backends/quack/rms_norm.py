"""QuACK RMSNorm (``quack.rmsnorm.rmsnorm``, CuTeDSL) on ``norm.rms_norm``'s signature.

QuACK computes x̂ and the weight multiply in fp32 and casts once (our casting="fp32"); ``offset``
is its ``weight_offset`` (a compile-time constant: one compile per distinct offset and N).
"""

from __future__ import annotations

import torch
from quack.rmsnorm import rmsnorm as _quack_rmsnorm

from .._dense import readable
from .._fallback import registered
from ._rows import rows

# what this impl does not take goes to the torch impl, resolved by name on first use (polykernel.backends._fallback)
_torch_rms_norm = registered("norm.rms_norm")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, casting: str) -> torch.Tensor:
    n = x.shape[-1]
    if x.numel() == 0 or casting != "fp32":
        return _torch_rms_norm(x, weight, eps, offset, casting)
    y = _quack_rmsnorm(rows(x, n), readable(weight), eps=eps, weight_offset=float(offset))
    return y.view(x.shape)
