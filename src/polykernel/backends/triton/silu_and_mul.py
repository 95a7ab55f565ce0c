"""Triton silu_and_mul (serving layout): swiglu's forward kernel on the two halves of x.

A thin registered impl: :func:`polykernel.backends.triton.glu.glu_and_mul` launches the gated
activations' elementwise kernel on row-strided views of x's halves (no copy) and writes ``out``.
One launch, no allocation when ``out``'s rows are addressable: CUDA-graph safe.
"""

from __future__ import annotations

import torch

from .glu import SILU, glu_and_mul


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The registered impl (arguments already validated by ``polykernel.silu_and_mul``)."""
    return glu_and_mul(x, out, SILU)
