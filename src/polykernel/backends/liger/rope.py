"""Liger-Kernel RoPE (``rope_forward``/``rope_backward``, HF rotate-half) on ``embedding.rope``.

Liger rotates in place: q.transpose(1, 2).contiguous() is q's own storage for the HF layout
(q a transposed view of [B, T, H, D]), and its backward rotates the incoming gradients in place.
The adapter hands Liger private copies where that would overwrite the caller's tensors. Liger
computes in cos/sin's dtype (q and k are converted to it) and reads only the first half of each
cos/sin row: it assumes HF's duplicated tables (cat(freqs, freqs)), which no argument class sees.
"""

from __future__ import annotations

import torch
from liger_kernel.ops.rope import rope_backward, rope_forward

from ..torch.rope import rope as _torch_rope


def _private(t: torch.Tensor) -> torch.Tensor:
    # Liger's .contiguous() of t.transpose(1, 2) copies unless it is already contiguous
    return t.clone() if t.transpose(1, 2).is_contiguous() else t


class _LigerRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):  # type: ignore[override]
        q_rot, k_rot, cos_, sin_ = rope_forward(_private(q), _private(k), cos, sin)
        ctx.save_for_backward(cos_, sin_)
        return q_rot, k_rot

    @staticmethod
    def backward(ctx, dq, dk):  # type: ignore[override]
        cos, sin = ctx.saved_tensors
        dq, dk = rope_backward(_private(dq), _private(dk), cos, sin)
        return dq, dk, None, None


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if q.numel() == 0 or k.numel() == 0 or cos.requires_grad or sin.requires_grad:
        return _torch_rope(q, k, cos, sin)
    return _LigerRope.apply(q, k, cos, sin)
