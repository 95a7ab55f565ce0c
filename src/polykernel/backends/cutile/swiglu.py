"""cuTile SwiGLU: ``silu(gate) * up``, forward and backward (kernels in :mod:`.glu`)."""

from __future__ import annotations

import torch

from .glu import SILU, glu


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The registered impl (arguments already validated by ``polykernel.swiglu``)."""
    return glu(gate, up, SILU)
