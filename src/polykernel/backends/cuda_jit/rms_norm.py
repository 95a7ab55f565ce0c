"""cuda_jit rms_norm (forward): ``csrc/rms_norm.cuh`` through :mod:`._host`; casting "fp32" and
"llama", any offset, a weight of x's dtype or fp32. Registered without a backward: a call that
needs a gradient takes the next impl."""

from __future__ import annotations

import torch

from . import _host


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, casting: str) -> torch.Tensor:
    return _host.rms_norm(x, weight, eps, offset, casting == "llama")
