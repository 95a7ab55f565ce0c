"""sgl-kernel ``torch.ops.sgl_kernel.gelu_and_mul`` (erf) on ``serving.gelu_and_mul``'s signature.
The tanh form is refused by the gate (its kernel's approximate hardware tanh misses the op's error
model: ``_serving_gates.gelu_and_mul``). x handed over dense, ``out`` written in place (else
through a dense buffer copied back)."""

from __future__ import annotations

import torch

from .._dense import readable, settle, writable
from ._ops import ops


def gelu_and_mul(x: torch.Tensor, approximate: str = "none", out: torch.Tensor | None = None) -> torch.Tensor:
    assert out is not None and approximate == "none"  # the public function allocates out; the gate refuses tanh
    if x.numel() == 0:
        return out
    buf = writable(out)
    ops.gelu_and_mul.default(buf, readable(x))
    return settle(out, buf)
