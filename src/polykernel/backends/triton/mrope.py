"""Triton M-RoPE: the three ``[3, B, T, D]`` tables merged by section into one ``[B, T, D]`` pair
in torch (a selection and a copy of the tables, small next to q and k), then rope's Triton impl
(``rope.py``): its kernels, strided q/k, forward and backward (dq, dk; no cos/sin gradient: the op's
predicate keeps this impl from being selected when they need one)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...ops.mrope import merge_sections
from . import rope as _rope


def mrope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mrope_section: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The registered impl (arguments already validated by ``polykernel.mrope``)."""
    if cos.requires_grad or sin.requires_grad:
        if torch.is_grad_enabled():  # a direct call: refuse rather than drop the table gradients
            raise NotImplementedError("embedding.mrope [triton]: no cos/sin gradients; use impl='torch'")
    with torch.no_grad():  # the tables need no graph here (see above)
        mc, ms = merge_sections(cos, mrope_section), merge_sections(sin, mrope_section)
    return _rope.rope(q, k, mc, ms)
