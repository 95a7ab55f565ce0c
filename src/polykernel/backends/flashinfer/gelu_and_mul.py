"""FlashInfer ``flashinfer.activation.gelu_and_mul`` (erf) on ``serving.gelu_and_mul``'s
signature: fp32 math, one rounding. The tanh form is refused by the gate (its kernel's approximate
hardware tanh misses the op's error model: ``_serving_gates.gelu_and_mul``). x is handed over
dense (else a dense copy), ``out`` written in place (else through a dense buffer copied back)."""

from __future__ import annotations

import torch
from flashinfer.activation import gelu_and_mul as _gelu_and_mul

from .._dense import readable, settle, writable


def gelu_and_mul(x: torch.Tensor, approximate: str = "none", out: torch.Tensor | None = None) -> torch.Tensor:
    assert out is not None and approximate == "none"  # the public function allocates out; the gate refuses tanh
    if x.numel() == 0:
        return out
    buf = writable(out)
    _gelu_and_mul(readable(x), out=buf)
    return settle(out, buf)
