"""FlashInfer ``flashinfer.activation.silu_and_mul`` on ``serving.silu_and_mul``'s signature: fp32
math, one rounding (the op's). x is handed over dense (else a dense copy), ``out`` written in place
(else through a dense buffer copied back)."""

from __future__ import annotations

import torch
from flashinfer.activation import silu_and_mul as _silu_and_mul

from .._dense import readable, settle, writable


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    assert out is not None  # the public function allocates it
    if x.numel() == 0:
        return out
    buf = writable(out)
    _silu_and_mul(readable(x), out=buf)
    return settle(out, buf)
