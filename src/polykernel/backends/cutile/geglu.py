"""cuTile GeGLU: ``gelu(gate, approximate) * up``, forward and backward (kernels in :mod:`.glu`)."""

from __future__ import annotations

import torch

from .glu import ACTS, glu


def geglu(gate: torch.Tensor, up: torch.Tensor, approximate: str) -> torch.Tensor:
    """The registered impl (arguments already validated by ``polykernel.geglu``)."""
    return glu(gate, up, ACTS[approximate])
