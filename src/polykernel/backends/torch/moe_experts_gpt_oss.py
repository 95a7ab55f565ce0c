"""PyTorch gpt-oss MoE experts: the token-expert pairs sorted by expert once, then per-expert GEMMs.

The same skeleton as :mod:`polykernel.backends.torch.moe_experts` (its sort, its grouped/looped
GEMM choice and its fallbacks to the reference): gpt-oss's ``[E, K, N]`` weights are the other
impl's ``[E, N, K]`` transposed, so they go in as transposed views (a contiguous ``[E, K, N]``
is a row-major operand for ``torch._grouped_mm``). The biases are gathered per sorted pair and
added in fp32 after each GEMM, the clamped SwiGLU in fp32 (rounded to the dtype for the down
GEMM), then the routing weights and the sum over each token's k pairs (no atomics), one rounding
at the end. autograd differentiates it all.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...ops.moe_experts_gpt_oss import OP_ID, clamped_swiglu, reference
from .. import _moe_experts as _base


def grouped_mm_refusal(hidden: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> str | None:
    """Why this call's GEMMs cannot use ``torch._grouped_mm`` (None: they do): the other impl's
    reasons, for the projections in gpt-oss's layout ``[E, H, 2I]``, ``[E, I, H]``."""
    return _base.refusal(hidden, down_proj.shape[1], gate_up_proj, down_proj)


def moe_experts_gpt_oss(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    gate_up_proj_bias: torch.Tensor,
    down_proj: torch.Tensor,
    down_proj_bias: torch.Tensor,
    alpha: float,
    limit: float,
) -> torch.Tensor:
    """The registered impl (arguments already validated by ``polykernel.moe_experts_gpt_oss``)."""
    args = (hidden, top_k_index, top_k_weights, gate_up_proj, gate_up_proj_bias, down_proj, down_proj_bias, alpha, limit)
    if not _base.plain(args[:7]):
        return reference(*args)
    why = grouped_mm_refusal(hidden, gate_up_proj, down_proj)
    if why is not None and _base.capturing(hidden):  # the loop's host sync is impossible
        return reference(*args)

    def experts(x: torch.Tensor, gemm: Callable, perm: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
        expert = top_k_index.reshape(-1).index_select(0, perm)  # each sorted pair's expert
        gate_up = gemm(x, gate_up_proj.mT).to(acc) + gate_up_proj_bias.index_select(0, expert).to(acc)
        inner = clamped_swiglu(gate_up, alpha, limit).to(hidden.dtype)
        return gemm(inner, down_proj.mT).to(acc) + down_proj_bias.index_select(0, expert).to(acc)

    return _base.sorted_experts(hidden, top_k_index, top_k_weights, gate_up_proj.shape[0], why is None, experts, OP_ID)
