"""PyTorch M-RoPE: the reference itself (the three tables merged by section, then rope's fp32
rotate-half). Autograd derives every gradient, cos/sin included, so this impl takes any argument
class."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...ops.mrope import reference


def mrope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mrope_section: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    return reference(q, k, cos, sin, mrope_section)
