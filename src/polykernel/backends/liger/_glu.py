"""Shared by the Liger SwiGLU and GeGLU adapters."""

from __future__ import annotations

import torch


def private(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor Liger may overwrite. Liger's GLU backward writes d(gate) and d(up) into
    the gate and up it saved; contiguous inputs are saved as they are, so the caller's tensors
    would hold gradients after backward. A copy only when grad is on (the forward writes nothing);
    ``clone`` keeps the autograd edge to the caller's tensor."""
    return t.clone(memory_format=torch.contiguous_format)
