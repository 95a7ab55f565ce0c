"""Triton SwiGLU: ``silu(gate) * up``, forward and backward.

A thin registered impl: the elementwise kernels (shared with geglu) live in
:mod:`polykernel.backends.triton.glu` — one pass over memory each way, fp32 math, the backward
recomputes silu from gate (only gate and up are saved), no atomics (deterministic).
"""

from __future__ import annotations

import torch

from .glu import SILU, glu


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The registered impl (arguments already validated by ``polykernel.swiglu``)."""
    return glu(gate, up, SILU)
