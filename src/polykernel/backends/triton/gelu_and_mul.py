"""Triton gelu_and_mul (serving layout): geglu's forward kernel (erf or tanh) on x's two halves.

A thin registered impl over :func:`polykernel.backends.triton.glu.glu_and_mul` (see
``silu_and_mul.py``): one launch, no copy of x, CUDA-graph safe.
"""

from __future__ import annotations

import torch

from .glu import ACTS, glu_and_mul


def gelu_and_mul(x: torch.Tensor, approximate: str = "none", out: torch.Tensor | None = None) -> torch.Tensor:
    """The registered impl (arguments already validated by ``polykernel.gelu_and_mul``)."""
    return glu_and_mul(x, out, ACTS[approximate])
