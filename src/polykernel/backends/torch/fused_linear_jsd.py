"""PyTorch fused linear JSD: the chunked driver (:mod:`polykernel.backends._fused_linear_jsd`) with a
torch per-chunk JSD, in a quarter of the driver's chunk budget (``TORCH_BUDGET``: its temporaries are a few fp32 chunks)."""

from __future__ import annotations

import torch

from ...ops._distill import plain

# (reference: semantics live in the op file; TORCH_BUDGET: this impl's share of the chunk budget)
from ...ops.fused_linear_jsd import TORCH_BUDGET, reference
from .._fused_linear_jsd import run
from .._jsd import terms

# ---------------------------------------------------------------------------------------------
# Registered impl


def _chunk(zs, zt, labels, beta, ignore_index, inv_t, scale, dz) -> torch.Tensor:
    """Per-row losses of one chunk of fp32 logits; with ``dz``, the dlogits times ``scale``."""
    x, y = (zs * inv_t).log_softmax(-1), (zt * inv_t).log_softmax(-1)
    term, d = terms(x, y, beta)
    rows = term.sum(-1)
    valid = None if labels is None else (labels != ignore_index)
    if valid is not None:
        rows = torch.where(valid, rows, 0.0)
    if dz is not None:
        g = (d - x.exp() * d.sum(-1, keepdim=True)) * (scale * inv_t)
        if valid is not None:
            g = torch.where(valid[:, None], g, 0.0)  # ignored rows: 0 (never inf·0 when none is scored)
        dz.copy_(g)
    return rows


def fused_linear_jsd(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    labels: torch.Tensor | None,
    beta: float,
    ignore_index: int,
    temperature: float,
) -> torch.Tensor:
    """The registered impl (arguments already validated by ``polykernel.fused_linear_jsd``)."""
    if not plain(student_hidden, student_weight, teacher_hidden, teacher_weight, labels):
        # a subclass (a DTensor, a wrapper): the reference's torch ops, its own dispatch on each
        # (this materializes the [N, V] logits)
        return reference(student_hidden, student_weight, teacher_hidden, teacher_weight, labels, beta, ignore_index, temperature)
    return run(
        student_hidden, student_weight, teacher_hidden, teacher_weight, labels, float(beta), ignore_index, float(temperature), _chunk,
        budget=TORCH_BUDGET,
    )  # fmt: skip
