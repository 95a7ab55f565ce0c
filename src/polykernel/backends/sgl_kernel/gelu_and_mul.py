"""sgl-kernel ``torch.ops.sgl_kernel.gelu_and_mul`` (erf) / ``gelu_tanh_and_mul`` (tanh) on
``serving.gelu_and_mul``'s signature. x handed over dense, ``out`` written in place (else through a
dense buffer copied back)."""

from __future__ import annotations

import torch

from .._dense import readable, settle, writable
from ._ops import ops


def gelu_and_mul(x: torch.Tensor, approximate: str = "none", out: torch.Tensor | None = None) -> torch.Tensor:
    assert out is not None  # the public function allocates it
    if x.numel() == 0:
        return out
    buf = writable(out)
    (ops.gelu_tanh_and_mul if approximate == "tanh" else ops.gelu_and_mul).default(buf, readable(x))
    return settle(out, buf)
