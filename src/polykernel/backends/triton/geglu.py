"""Triton GeGLU: ``gelu(gate, approximate) * up``, forward and backward.

A thin registered impl: the elementwise kernels (shared with swiglu) live in
:mod:`polykernel.backends.triton.glu` — one pass over memory each way, fp32 math, the backward
recomputes gelu from gate (only gate and up are saved), no atomics (deterministic).
``approximate="tanh"`` uses ``0.5·(1 + tanh(z)) = sigmoid(2z)``; ``"none"`` uses erf.
"""

from __future__ import annotations

import torch

from .glu import ACTS, glu


def geglu(gate: torch.Tensor, up: torch.Tensor, approximate: str) -> torch.Tensor:
    """The registered impl (arguments already validated by ``polykernel.geglu``)."""
    return glu(gate, up, ACTS[approximate])
