"""Liger-Kernel's fused MoE (``LigerFusedMoEFunction``, 0.8.5) on ``moe.moe_experts``'s signature.

Liger's kernels are SwiGLU experts in transformers' layout (the predicate refuses other
activations and fp32 routing weights with 16-bit hidden states). It takes an int32 index, reads
its tile count on the host (one sync per call: not CUDA-graph safe), rounds the pre-activations
and each expert's output to the dtype, and sums the routing weights' gradient with atomics (not
deterministic). Without token-expert pairs its kernels would launch empty grids: the torch impl
takes those calls. Liger does not check the index range; the adapter asserts it on the device,
as the sort of the other impls does (an index outside [0, E) would index its buffers out of
bounds).
"""

from __future__ import annotations

import torch
from liger_kernel.ops.fused_moe import LigerFusedMoEFunction

from .. import _moe_route as route
from .._double_backward import refusing
from .._fallback import registered

# what this impl does not take goes to the torch impl, resolved by name on first use (polykernel.backends._fallback)
_torch_moe_experts = registered("moe.moe_experts")

# create_graph=True: second derivatives raise, naming the op, instead of reading zeros (refusing())
_FusedMoE = refusing(LigerFusedMoEFunction, "moe.moe_experts", "liger", (0, 1, 2, 4), kept=False)


def moe_experts(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    activation: str,
) -> torch.Tensor:
    if top_k_index.numel() == 0:
        return _torch_moe_experts(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, activation)
    route.assert_in_range(top_k_index, gate_up_proj.shape[0])
    return _FusedMoE.apply(hidden, gate_up_proj, down_proj, top_k_index.to(torch.int32), top_k_weights)
