"""Mixture-of-experts expert layers: MoEExperts."""

from __future__ import annotations

import torch
from torch import nn

import polykernel

from ._common import _check_impl, _count, _impl_repr


class MoEExperts(nn.Module):
    """A mixture-of-experts layer's routed experts, through ``polykernel.moe_experts``.

    transformers' ``Experts`` layout and names (``Qwen3MoeExperts``, ``MixtralExperts``):
    ``gate_up_proj [E, 2I, H]`` (gate rows first), ``down_proj [E, H, I]``, so state dicts load
    across. ``forward(hidden_states, top_k_index, top_k_weights)`` takes ``[..., H]`` tokens and
    ``[..., k]`` routing (e.g. from ``polykernel.moe_router``) and returns ``[..., H]``.
    Parameters start like ``nn.Linear``'s weights (uniform, bound ``1/√fan_in``).

    >>> import torch, polykernel, polykernel.nn as pnn
    >>> experts = pnn.MoEExperts(num_experts=4, hidden_size=16, intermediate_size=24)
    >>> x = torch.randn(2, 5, 16)
    >>> weights, index = polykernel.moe_router(torch.randn(2, 5, 4), 2)
    >>> experts(x, index, weights).shape
    torch.Size([2, 5, 16])
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        activation: str = "silu",
        *,
        impl: str | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        from polykernel.ops.moe_experts import ACTIVATIONS

        if activation not in ACTIVATIONS:
            raise ValueError(f"MoEExperts: activation must be one of {', '.join(map(repr, ACTIVATIONS))}, got {activation!r}")
        cls = type(self).__name__
        self.num_experts = _count(cls, "num_experts", num_experts)
        self.hidden_size = _count(cls, "hidden_size", hidden_size)
        self.intermediate_size = _count(cls, "intermediate_size", intermediate_size)
        self.activation = activation
        self.impl = _check_impl(type(self).__name__, impl)
        kw = {"device": device, "dtype": dtype}
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * self.intermediate_size, self.hidden_size, **kw))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, self.hidden_size, self.intermediate_size, **kw))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.gate_up_proj.uniform_(-(self.hidden_size**-0.5), self.hidden_size**-0.5)
            self.down_proj.uniform_(-(self.intermediate_size**-0.5), self.intermediate_size**-0.5)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        out = polykernel.moe_experts(
            hidden_states.reshape(-1, shape[-1]),
            top_k_index.reshape(-1, top_k_index.shape[-1]),
            top_k_weights.reshape(-1, top_k_weights.shape[-1]),
            self.gate_up_proj,
            self.down_proj,
            activation=self.activation,
            impl=self.impl,
        )
        return out.view(shape)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
            f"activation={self.activation!r}" + _impl_repr(self.impl)
        )
