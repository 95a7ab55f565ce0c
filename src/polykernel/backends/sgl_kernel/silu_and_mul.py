"""sgl-kernel ``torch.ops.sgl_kernel.silu_and_mul(out, input)`` on ``serving.silu_and_mul``'s
signature: fp32 math, one rounding. x handed over dense, ``out`` written in place (else through a
dense buffer copied back)."""

from __future__ import annotations

import torch

from .._dense import readable, settle, writable
from ._ops import ops


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    assert out is not None  # the public function allocates it
    if x.numel() == 0:
        return out
    buf = writable(out)
    ops.silu_and_mul.default(buf, readable(x))
    return settle(out, buf)
