"""FlashInfer ``flashinfer.activation.gelu_and_mul`` (erf) / ``gelu_tanh_and_mul`` (tanh) on
``serving.gelu_and_mul``'s signature: fp32 math, one rounding. x is handed over dense (else a dense
copy), ``out`` written in place (else through a dense buffer copied back)."""

from __future__ import annotations

import torch
from flashinfer.activation import gelu_and_mul as _gelu_and_mul
from flashinfer.activation import gelu_tanh_and_mul as _gelu_tanh_and_mul

from .._dense import readable, settle, writable


def gelu_and_mul(x: torch.Tensor, approximate: str = "none", out: torch.Tensor | None = None) -> torch.Tensor:
    assert out is not None  # the public function allocates it
    if x.numel() == 0:
        return out
    buf = writable(out)
    (_gelu_tanh_and_mul if approximate == "tanh" else _gelu_and_mul)(readable(x), out=buf)
    return settle(out, buf)
