"""PyTorch MoE experts: the token-expert pairs sorted by expert once, then per-expert GEMMs.

The GEMMs over the sorted pairs run one of two ways, chosen per call:

- ``torch._grouped_mm`` (one launch per projection, offsets on the device: no host sync) where it
  runs: probed once per device and dtype (:func:`grouped_mm_refusal` says why not: a torch
  without it, float64, H or I not a multiple of 16 bytes, deterministic mode, a probe that
  raised);
- else one ``F.linear`` per non-empty expert, which reads the group offsets on the host (one sync
  per call). Under CUDA-graph capture, where a sync is impossible, the call runs the reference
  (every expert on all tokens, masked: E/k times the work, but graph-safe), as it does for meta
  tensors, tensor subclasses and under functorch transforms.

Then ``act(gate)·up`` in fp32 (rounded to the dtype for the down GEMM), the down GEMM, the
routing weights and the sum over each token's k pairs in fp32 (a gather back to token order and a
sum: no atomics), one rounding at the end. autograd differentiates it all.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...ops.moe_experts import activate, reference
from .._moe_experts import capturing, grouped_mm_refusal, plain, sorted_experts


def moe_experts(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    activation: str,
) -> torch.Tensor:
    """The registered impl (arguments already validated by ``polykernel.moe_experts``)."""
    args = (hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, activation)
    if not plain(args[:5]):
        return reference(*args)
    why = grouped_mm_refusal(hidden, gate_up_proj, down_proj)
    if why is not None and capturing(hidden):  # the loop's host sync is impossible
        return reference(*args)

    def experts(x: torch.Tensor, gemm: Callable, perm: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
        gate, up = gemm(x, gate_up_proj).to(acc).chunk(2, dim=-1)
        inner = (activate(gate, activation) * up).to(hidden.dtype)
        return gemm(inner, down_proj).to(acc)

    return sorted_experts(hidden, top_k_index, top_k_weights, gate_up_proj.shape[0], why is None, experts)
