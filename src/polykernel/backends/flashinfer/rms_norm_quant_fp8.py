"""FlashInfer ``flashinfer.norm.rmsnorm_quant`` on ``serving.rms_norm_quant_fp8``'s signature:
x normalised in fp32, times the weight, times 1/scale (the op divides: the two differ by an fp32
rounding, far inside the fp8 rounding the error model allows), clamped to ±448, written into q
(e4m3). One scale per tensor (the gate refuses per-row scales). x handed over dense, q written in
place (else through a dense buffer copied back)."""

from __future__ import annotations

import torch
from flashinfer.norm import rmsnorm_quant

from .._dense import readable, settle, uint32_parts, writable


def rms_norm_quant_fp8(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6, q: torch.Tensor | None = None
) -> torch.Tensor:
    assert q is not None  # the public function allocates it
    if x.numel() == 0:
        return q
    n = x.shape[-1]
    buf = writable(q)
    w, s = readable(weight), scale.reshape(1).contiguous()
    for qs, xs in uint32_parts(buf.view(-1, n), readable(x).view(-1, n)):  # uint32 row offsets (_dense.UINT32_ELEMS)
        rmsnorm_quant(qs, xs, w, s, eps)
    return settle(q, buf)
