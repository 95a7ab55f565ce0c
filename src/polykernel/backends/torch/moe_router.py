"""PyTorch MoE router: the reference's torch ops (softmax, a stable sort of the logits, gather),
differentiated by autograd. E is small (8 to 256 experts), so the sort costs little."""

from __future__ import annotations

import torch

from ...ops.moe_router import reference


def moe_router(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return reference(logits, top_k, renormalize)
