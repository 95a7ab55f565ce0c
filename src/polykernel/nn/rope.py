"""Rotary position embeddings: RotaryEmbedding."""

from __future__ import annotations

import torch
from torch import nn

import polykernel

from ._common import _check_impl, _count, _impl_repr, _number


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (Hugging Face rotate-half convention) applied with
    ``polykernel.rope``.

    ``cos_sin(positions, dtype)`` gives ``cos``/``sin`` of shape ``[B or 1, T, head_dim]`` (computed
    in fp32, cast to ``dtype``, as Hugging Face does); ``forward(q, k, positions=None)`` rotates
    ``q [B, Hq, T, D]`` and ``k [B, Hk, T, D]`` (positions default to ``0..T-1``).

    >>> import torch, polykernel.nn as pnn
    >>> rot = pnn.RotaryEmbedding(16, max_position_embeddings=128)
    >>> cos, sin = rot.cos_sin(torch.arange(10), torch.float32)
    >>> cos.shape
    torch.Size([1, 10, 16])
    >>> q, k = torch.randn(2, 4, 10, 16), torch.randn(2, 2, 10, 16)
    >>> q_rot, k_rot = rot(q, k)
    >>> q_rot.shape, k_rot.shape
    (torch.Size([2, 4, 10, 16]), torch.Size([2, 2, 10, 16]))
    """

    def __init__(
        self,
        head_dim: int,
        max_position_embeddings: int = 2048,
        base: float = 10000.0,
        *,
        impl: str | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = _count("RotaryEmbedding", "head_dim", head_dim)
        if self.head_dim % 2:
            raise ValueError(f"RotaryEmbedding: head_dim must be even, got {head_dim}")
        self.max_position_embeddings = _count("RotaryEmbedding", "max_position_embeddings", max_position_embeddings)
        # base**(-2i/d): a bool (1), 0, a negative or non-finite base gives constant, inf or NaN frequencies
        self.base = _number("RotaryEmbedding", "base", base, positive=True)
        self.impl = _check_impl(type(self).__name__, impl)
        self.register_buffer("inv_freq", torch.empty(self.head_dim // 2, device=device, dtype=torch.float32), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Recompute ``inv_freq`` (a non-persistent buffer: also after ``to_empty``/meta init)."""
        exponent = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=self.inv_freq.device) / self.head_dim
        with torch.no_grad():
            self.inv_freq.copy_(1.0 / (self.base**exponent))

    def _apply(self, fn, recurse: bool = True):
        """``.to(dtype)``/``.half()``/``model.to(torch.bfloat16)`` cast every floating buffer;
        ``inv_freq`` stays fp32 (recomputed, exactly): a bf16 one is off by up to 2^-9 relative,
        which at position 2000 turns the angles by radians (silently wrong cos/sin)."""
        super()._apply(fn, recurse)
        if self.inv_freq.dtype != torch.float32:
            self.inv_freq = torch.empty(self.inv_freq.shape, device=self.inv_freq.device, dtype=torch.float32)
            self.reset_parameters()
        return self

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions`` ``[T]`` or ``[B, T]`` -> ``(cos, sin)`` of shape ``[1 or B, T, head_dim]``."""
        pos = positions if positions.dim() == 2 else positions[None]
        freqs = pos.to(device=self.inv_freq.device, dtype=torch.float32)[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if positions is None:
            positions = torch.arange(q.shape[-2], device=q.device)
        cos, sin = self.cos_sin(positions, q.dtype)
        return polykernel.rope(q, k, cos, sin, impl=self.impl)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_position_embeddings={self.max_position_embeddings}, base={self.base:g}" + _impl_repr(
            self.impl
        )
