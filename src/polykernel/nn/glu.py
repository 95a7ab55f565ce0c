"""Gated MLPs (Hugging Face parameter names): SwiGLU and GEGLU."""

from __future__ import annotations

import torch
from torch import nn

import polykernel

from ._common import _check_impl, _count, _impl_repr


class _GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with Hugging Face parameter names."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool,
        impl: str | None,
        device: torch.device | str | None,
        dtype: torch.dtype | None,
    ) -> None:
        super().__init__()
        self.hidden_size = _count(type(self).__name__, "hidden_size", hidden_size)
        self.intermediate_size = _count(type(self).__name__, "intermediate_size", intermediate_size)
        self.impl = _check_impl(type(self).__name__, impl)
        kw = {"bias": bias, "device": device, "dtype": dtype}
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, **kw)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, **kw)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, **kw)

    def reset_parameters(self) -> None:
        for lin in (self.gate_proj, self.up_proj, self.down_proj):
            lin.reset_parameters()

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}" + _impl_repr(self.impl)


class SwiGLU(_GatedMLP):
    """The Llama MLP: ``down_proj(silu(gate_proj(x)) * up_proj(x))``, the gate through
    ``polykernel.swiglu``.

    >>> import torch, polykernel.nn as pnn
    >>> mlp = pnn.SwiGLU(32, 86)
    >>> mlp(torch.randn(2, 7, 32)).shape
    torch.Size([2, 7, 32])
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool = False,
        *,
        impl: str | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(hidden_size, intermediate_size, bias, impl, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(polykernel.swiglu(self.gate_proj(x), self.up_proj(x), impl=self.impl))


class GEGLU(_GatedMLP):
    """The Gemma MLP: ``down_proj(gelu(gate_proj(x)) * up_proj(x))``, the gate through
    ``polykernel.geglu``; ``approximate`` is ``"tanh"`` (Gemma) or ``"none"`` (exact erf).

    >>> import torch, polykernel.nn as pnn
    >>> mlp = pnn.GEGLU(32, 86, approximate="none")
    >>> mlp(torch.randn(2, 7, 32)).shape
    torch.Size([2, 7, 32])
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool = False,
        approximate: str = "tanh",
        *,
        impl: str | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(hidden_size, intermediate_size, bias, impl, device, dtype)
        if approximate not in ("tanh", "none"):
            raise ValueError(f"GEGLU: approximate must be 'tanh' or 'none', got {approximate!r}")
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(polykernel.geglu(self.gate_proj(x), self.up_proj(x), approximate=self.approximate, impl=self.impl))

    def extra_repr(self) -> str:
        return super().extra_repr() + f", approximate={self.approximate!r}"
