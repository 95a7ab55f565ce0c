"""PyTorch RoPE: the reference itself (fp32 rotate-half in eager torch; cos/sin converted once and
shared by q and k). Autograd derives every gradient, cos/sin included, so this impl takes any
argument class."""

from __future__ import annotations

import torch

from ...ops.rope import reference


def rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int | None = None, interleaved: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    return reference(q, k, cos, sin, rotary_dim, interleaved)
