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

import torch

from ... import _compat
from ...ops.moe_experts_gpt_oss import OP_ID, clamped_swiglu, reference
from . import _moe_route as route
from . import moe_experts as _base


def grouped_mm_refusal(hidden: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> str | None:
    """Why this call's GEMMs cannot use ``torch._grouped_mm`` (None: they do): the other impl's
    reasons, for the projections in gpt-oss's layout ``[E, H, 2I]``, ``[E, I, H]``."""
    if _compat.grouped_mm is None:
        return f"no torch._grouped_mm here ({_compat.fallbacks().get('grouped_mm', 'missing')})"
    if hidden.dtype == torch.float64:
        return "torch._grouped_mm takes fp32/bf16/fp16 only"
    if torch.are_deterministic_algorithms_enabled():
        return "deterministic mode: torch._grouped_mm makes no determinism promise"
    elt = hidden.element_size()
    if (hidden.shape[1] * elt) % 16 or (down_proj.shape[1] * elt) % 16:
        return "torch._grouped_mm needs H and I to be multiples of 16 bytes (its strides)"
    if not (gate_up_proj.is_contiguous() and down_proj.is_contiguous()) or (gate_up_proj.data_ptr() | down_proj.data_ptr()) % 16:
        return "torch._grouped_mm needs contiguous, 16-byte aligned projections"
    if _base.capturing(hidden) and (hidden.device, hidden.dtype) not in _base._probed:
        return "not probed yet, and no probe may run during CUDA-graph capture"
    return _base._probe(hidden.device, hidden.dtype)


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
    if _base._transforms_active() or hidden.is_meta or not all(type(a) in _base._PLAIN for a in args[:7]):
        return reference(*args)
    refusal = grouped_mm_refusal(hidden, gate_up_proj, down_proj)
    if refusal is not None and _base.capturing(hidden):  # the loop's host sync is impossible
        return reference(*args)
    gemm = _base._grouped if refusal is None else _base._looped
    t, h = hidden.shape
    k = top_k_index.shape[1]
    perm, offsets = route.sort_by_expert(top_k_index, gate_up_proj.shape[0], op_id=OP_ID)
    expert = top_k_index.reshape(-1).index_select(0, perm)  # each sorted pair's expert
    x = hidden.index_select(0, perm // k)  # [S, H], pairs by expert
    if refusal is None:
        x = x.contiguous()
    acc = torch.promote_types(torch.promote_types(hidden.dtype, top_k_weights.dtype), torch.float32)
    gate_up = gemm(x, gate_up_proj.mT, offsets).to(acc) + gate_up_proj_bias.index_select(0, expert).to(acc)
    inner = clamped_swiglu(gate_up, alpha, limit).to(hidden.dtype)
    y = gemm(inner, down_proj.mT, offsets).to(acc) + down_proj_bias.index_select(0, expert).to(acc)  # [S, H]
    weighted = y * top_k_weights.reshape(-1).index_select(0, perm).to(acc)[:, None]
    out = weighted.index_select(0, route.inverse(perm)).view(t, k, h).sum(1)  # back to token order, Σ over k
    return out.to(hidden.dtype)
