"""``torch.nn`` modules over polykernel's ops: drop-in layers whose kernels the dispatcher picks.

Every module takes ``impl=`` (``None``: the dispatcher's choice for each call, i.e. scope, env,
``set_impl``, tuning, then rank) and passes it to the op on every call, so a module can be pinned
to one impl (strict: an impl that cannot run raises ``ImplNotAvailableError``)::

    >>> import torch, polykernel.nn as pnn
    >>> norm = pnn.RMSNorm(64)
    >>> norm(torch.randn(2, 5, 64)).shape
    torch.Size([2, 5, 64])
    >>> mlp = pnn.SwiGLU(64, 172, impl="torch")  # pinned to the torch impl
    >>> mlp(torch.randn(2, 5, 64)).shape
    torch.Size([2, 5, 64])

Parameter names follow PyTorch and Hugging Face (``weight``, ``bias``; ``gate_proj``, ``up_proj``,
``down_proj``), so state dicts load across.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

import polykernel
from polykernel.core.selection import _parse_names

__all__ = [
    "GEGLU",
    "CrossEntropyLoss",
    "DyT",
    "FusedLinearCPOLoss",
    "FusedLinearCrossEntropyLoss",
    "FusedLinearDPOLoss",
    "FusedLinearGRPOLoss",
    "FusedLinearJSDLoss",
    "FusedLinearKTOLoss",
    "FusedLinearORPOLoss",
    "FusedLinearSimPOLoss",
    "GroupNorm",
    "JSDLoss",
    "KLDivLoss",
    "LayerNorm",
    "MoEExperts",
    "PolyNorm",
    "RMSNorm",
    "ReLUSquared",
    "RotaryEmbedding",
    "Softmax",
    "Sparsemax",
    "SwiGLU",
    "TVDLoss",
]


def _impl_repr(impl: str | None) -> str:
    return f", impl={impl!r}" if impl is not None else ""


def _check_impl(cls: str, impl: str | None) -> str | None:
    """Fail at construction, not at the first call, on a name that is no impl at all."""
    if impl is not None:
        _parse_names(impl, f"{cls}(impl=)")
    return impl


class RMSNorm(nn.Module):
    """RMSNorm over the last dim: ``x / sqrt(mean(x²) + eps) * (weight + offset)``.

    ``casting="fp32"`` matches ``torch.nn.RMSNorm`` (fp32 math, one cast at the end);
    ``"llama"`` matches Hugging Face Llama (normalized x cast to x.dtype before the weight).
    Gemma's ``x̂ · (1 + w)`` is ``offset=1.0``. The weight is initialized to ``1 - offset``, so a
    fresh module scales by one either way.

    ``forward(x, residual=None)``: with a residual it returns ``(rms_norm(x + residual),
    x + residual)``, through the fused op ``polykernel.fused_add_rms_norm`` for ``casting="fp32"``
    (that op has no casting option), else an add and ``rms_norm``.

    >>> import torch, polykernel.nn as pnn
    >>> norm = pnn.RMSNorm(8, eps=1e-5)
    >>> y = norm(torch.randn(4, 8))
    >>> norm
    RMSNorm((8,), eps=1e-05, casting='fp32')
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        *,
        offset: float = 0.0,
        casting: str = "fp32",
        impl: str | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.hidden_size = int(hidden_size)
        self.eps = eps
        self.offset = offset
        if casting not in ("fp32", "llama"):
            raise ValueError(f"RMSNorm: casting must be 'fp32' or 'llama', got {casting!r}")
        self.casting = casting
        self.impl = _check_impl(type(self).__name__, impl)
        self.weight = nn.Parameter(torch.empty(self.hidden_size, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.constant_(self.weight, 1.0 - self.offset)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            if self.casting != "fp32":  # the fused op rounds like casting="fp32": add, then normalize
                s = x + residual
                return polykernel.rms_norm(s, self.weight, self.eps, offset=self.offset, casting=self.casting, impl=self.impl), s
            return polykernel.fused_add_rms_norm(x, residual, self.weight, self.eps, offset=self.offset, impl=self.impl)
        return polykernel.rms_norm(x, self.weight, self.eps, offset=self.offset, casting=self.casting, impl=self.impl)

    def extra_repr(self) -> str:
        s = f"({self.hidden_size},), eps={self.eps}"
        if self.offset:
            s += f", offset={self.offset}"
        return s + f", casting={self.casting!r}" + _impl_repr(self.impl)


class LayerNorm(nn.Module):
    """LayerNorm over the last dim, like ``torch.nn.LayerNorm(hidden_size)`` (fp32 math).

    >>> import torch, polykernel.nn as pnn
    >>> ln = pnn.LayerNorm(16, bias=False)
    >>> ln(torch.randn(3, 16)).shape
    torch.Size([3, 16])
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        *,
        impl: str | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.hidden_size = int(hidden_size)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.impl = _check_impl(type(self).__name__, impl)
        if elementwise_affine:
            self.weight = nn.Parameter(torch.empty(self.hidden_size, device=device, dtype=dtype))
            self.bias = nn.Parameter(torch.empty(self.hidden_size, device=device, dtype=dtype)) if bias else None
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return polykernel.layer_norm(x, self.weight, self.bias, self.eps, impl=self.impl)

    def extra_repr(self) -> str:
        return (
            f"({self.hidden_size},), eps={self.eps}, elementwise_affine={self.elementwise_affine}, bias={self.bias is not None}"
            + _impl_repr(self.impl)
        )


class GroupNorm(nn.Module):
    """GroupNorm of ``x [N, C, *]``, like ``torch.nn.GroupNorm(num_groups, num_channels)`` (fp32
    math); ``affine=False`` has no weight or bias.

    >>> import torch, polykernel.nn as pnn
    >>> gn = pnn.GroupNorm(4, 32)
    >>> gn(torch.randn(2, 32, 8, 8)).shape
    torch.Size([2, 32, 8, 8])
    """

    def __init__(
        self,
        num_groups: int,
        num_channels: int,
        eps: float = 1e-5,
        affine: bool = True,
        *,
        impl: str | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if num_channels % num_groups:
            raise ValueError(f"GroupNorm: num_groups {num_groups} must divide num_channels {num_channels}")
        self.num_groups = int(num_groups)
        self.num_channels = int(num_channels)
        self.eps = eps
        self.affine = affine
        self.impl = _check_impl(type(self).__name__, impl)
        if affine:
            self.weight = nn.Parameter(torch.empty(self.num_channels, device=device, dtype=dtype))
            self.bias = nn.Parameter(torch.empty(self.num_channels, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.affine:
            nn.init.ones_(self.weight)
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return polykernel.group_norm(x, self.num_groups, self.weight, self.bias, self.eps, impl=self.impl)

    def extra_repr(self) -> str:
        return f"{self.num_groups}, {self.num_channels}, eps={self.eps}, affine={self.affine}" + _impl_repr(self.impl)


class DyT(nn.Module):
    """Dynamic Tanh over the last dim, ``weight·tanh(alpha·x) + bias`` (a LayerNorm replacement):
    ``alpha`` is one learnable number (initialized to ``init_alpha``), ``weight`` ones and
    ``bias`` zeros (``bias=False``: none).

    >>> import torch, polykernel.nn as pnn
    >>> dyt = pnn.DyT(16)
    >>> dyt(torch.randn(3, 16)).shape
    torch.Size([3, 16])
    """

    def __init__(
        self,
        hidden_size: int,
        init_alpha: float = 0.5,
        bias: bool = True,
        *,
        impl: str | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.hidden_size = int(hidden_size)
        self.init_alpha = float(init_alpha)
        self.impl = _check_impl(type(self).__name__, impl)
        self.alpha = nn.Parameter(torch.empty(1, device=device, dtype=dtype))
        self.weight = nn.Parameter(torch.empty(self.hidden_size, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(self.hidden_size, device=device, dtype=dtype)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.constant_(self.alpha, self.init_alpha)
        nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return polykernel.dyt(x, self.alpha, self.weight, self.bias, impl=self.impl)

    def extra_repr(self) -> str:
        return f"({self.hidden_size},), init_alpha={self.init_alpha}, bias={self.bias is not None}" + _impl_repr(self.impl)


class PolyNorm(nn.Module):
    """PolyNorm over the last dim, ``w0·norm(x³) + w1·norm(x²) + w2·norm(x) + b`` (norm: RMS
    normalisation); ``weight`` (3 elements) starts at 1/3 each and ``bias`` (one number) at 1, as
    in the PolyCom reference.

    >>> import torch, polykernel.nn as pnn
    >>> pnn.PolyNorm()(torch.randn(3, 16)).shape
    torch.Size([3, 16])
    """

    def __init__(
        self,
        eps: float = 1e-6,
        *,
        impl: str | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.impl = _check_impl(type(self).__name__, impl)
        self.weight = nn.Parameter(torch.empty(3, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty((), device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.constant_(self.weight, 1.0 / 3.0)
        nn.init.constant_(self.bias, 1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return polykernel.poly_norm(x, self.weight, self.bias, self.eps, impl=self.impl)

    def extra_repr(self) -> str:
        return f"eps={self.eps}" + _impl_repr(self.impl)


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
        self.hidden_size = int(hidden_size)
        self.intermediate_size = int(intermediate_size)
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
        self.num_experts = int(num_experts)
        self.hidden_size = int(hidden_size)
        self.intermediate_size = int(intermediate_size)
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


class _Parameterless(nn.Module):
    """A module with no parameters: only the op's ``impl=`` (Softmax, ReLUSquared)."""

    def __init__(self, *, impl: str | None = None) -> None:
        super().__init__()
        self.impl = _check_impl(type(self).__name__, impl)

    def extra_repr(self) -> str:
        return _impl_repr(self.impl).removeprefix(", ")


class Softmax(_Parameterless):
    """Softmax over the last dim (fp32 math, output in the input dtype).

    >>> import torch, polykernel.nn as pnn
    >>> pnn.Softmax()(torch.zeros(2, 4))
    tensor([[0.2500, 0.2500, 0.2500, 0.2500],
            [0.2500, 0.2500, 0.2500, 0.2500]])
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return polykernel.softmax(x, impl=self.impl)


class ReLUSquared(_Parameterless):
    """``relu(x)²``, elementwise (fp32 math, output in the input dtype).

    >>> import torch, polykernel.nn as pnn
    >>> pnn.ReLUSquared()(torch.tensor([-1.0, 0.5, 2.0]))
    tensor([0.0000, 0.2500, 4.0000])
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return polykernel.relu_squared(x, impl=self.impl)


class Sparsemax(nn.Module):
    """Sparsemax along ``dim``: a probability vector per row, with exact zeros (fp32 math).

    >>> import torch, polykernel.nn as pnn
    >>> pnn.Sparsemax()(torch.tensor([[1.0, 0.8, -1.0]]))
    tensor([[0.6000, 0.4000, 0.0000]])
    """

    def __init__(self, dim: int = -1, *, impl: str | None = None) -> None:
        super().__init__()
        self.dim = int(dim)
        self.impl = _check_impl(type(self).__name__, impl)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return polykernel.sparsemax(x, self.dim, impl=self.impl)

    def extra_repr(self) -> str:
        return f"dim={self.dim}" + _impl_repr(self.impl)


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
        if head_dim % 2:
            raise ValueError(f"RotaryEmbedding: head_dim must be even, got {head_dim}")
        self.head_dim = int(head_dim)
        self.max_position_embeddings = int(max_position_embeddings)
        self.base = float(base)
        self.impl = _check_impl(type(self).__name__, impl)
        self.register_buffer("inv_freq", torch.empty(self.head_dim // 2, device=device, dtype=torch.float32), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Recompute ``inv_freq`` (a non-persistent buffer: also after ``to_empty``/meta init)."""
        exponent = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=self.inv_freq.device) / self.head_dim
        with torch.no_grad():
            self.inv_freq.copy_(1.0 / (self.base**exponent))

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


def _check_loss_options(cls: str, ignore_index: int, label_smoothing: float, reduction: str) -> None:
    """The loss ops' own option checks, at construction (errors name the module)."""
    from .ops.cross_entropy import validate_options

    validate_options(cls, ignore_index, label_smoothing, reduction)


def _check_ce_extras(cls: str, softcap: float | None, z_loss: float) -> None:
    """softcap and z_loss, at construction (the weights are checked against the logits per call)."""
    from .ops import _checks

    if softcap is not None:
        _checks.positive_float(cls, "softcap", softcap)
        _checks.finite_float(cls, "softcap", softcap)
    _checks.nonnegative_float(cls, "z_loss", z_loss)
    _checks.finite_float(cls, "z_loss", z_loss)


def _extras_repr(softcap: float | None, z_loss: float, has_weight: bool = False) -> str:
    out = ", weight=..." if has_weight else ""
    out += "" if softcap is None else f", softcap={softcap}"
    return out + ("" if not z_loss else f", z_loss={z_loss}")


class CrossEntropyLoss(nn.Module):
    """Cross-entropy of ``logits [..., V]`` against class indices ``target [...]`` (fp32 result).

    Unlike ``torch.nn.CrossEntropyLoss`` the class dim is the *last* one (the LM layout
    ``[B, T, V]``); ``reduction="none"`` returns ``target``'s shape.
    Targets equal to ``ignore_index`` add nothing and do not count in the mean.

    >>> import torch, polykernel.nn as pnn
    >>> loss_fn = pnn.CrossEntropyLoss(label_smoothing=0.1)
    >>> loss = loss_fn(torch.randn(2, 5, 11), torch.randint(0, 11, (2, 5)))
    >>> loss.shape, loss.dtype
    (torch.Size([]), torch.float32)

    ``weight`` (class weights ``[V]``, a buffer as in ``torch.nn.CrossEntropyLoss``), ``softcap``
    and ``z_loss``: see :func:`polykernel.cross_entropy`.
    """

    def __init__(
        self,
        ignore_index: int = -100,
        label_smoothing: float = 0.0,
        reduction: str = "mean",
        *,
        weight: torch.Tensor | None = None,
        softcap: float | None = None,
        z_loss: float = 0.0,
        impl: str | None = None,
    ) -> None:
        super().__init__()
        _check_loss_options(type(self).__name__, ignore_index, label_smoothing, reduction)
        _check_ce_extras(type(self).__name__, softcap, z_loss)
        self.ignore_index = ignore_index
        self.label_smoothing = label_smoothing
        self.reduction = reduction
        self.register_buffer("weight", weight)
        self.softcap = softcap
        self.z_loss = z_loss
        self.impl = _check_impl(type(self).__name__, impl)

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return polykernel.cross_entropy(
            logits,
            target,
            ignore_index=self.ignore_index,
            label_smoothing=self.label_smoothing,
            reduction=self.reduction,
            weight=self.weight,
            softcap=self.softcap,
            z_loss=self.z_loss,
            impl=self.impl,
        )

    def extra_repr(self) -> str:
        return (
            f"ignore_index={self.ignore_index}, label_smoothing={self.label_smoothing}, reduction={self.reduction!r}"
            + _extras_repr(self.softcap, self.z_loss, self.weight is not None)
            + _impl_repr(self.impl)
        )


class FusedLinearCrossEntropyLoss(nn.Module):
    """``cross_entropy(hidden @ weight.T + bias, target)`` without materializing the logits.

    ``forward(hidden [..., H], weight [V, H], target [...], bias=None)``; the LM head's weight is
    passed in (the module owns no parameters), so it stays tied to / sharded with the model.

    >>> import torch, polykernel.nn as pnn
    >>> head = torch.nn.Linear(32, 100, bias=False)
    >>> loss_fn = pnn.FusedLinearCrossEntropyLoss()
    >>> loss = loss_fn(torch.randn(2, 6, 32), head.weight, torch.randint(0, 100, (2, 6)))
    >>> loss.backward()  # gradients reach head.weight
    >>> head.weight.grad.shape
    torch.Size([100, 32])

    ``ce_weight`` (class weights ``[V]``, a buffer), ``softcap``, ``z_loss`` and
    ``return_token_accuracy`` (then ``forward`` returns ``(loss, accuracy)``): see
    :func:`polykernel.fused_linear_cross_entropy`.
    """

    def __init__(
        self,
        ignore_index: int = -100,
        label_smoothing: float = 0.0,
        reduction: str = "mean",
        *,
        ce_weight: torch.Tensor | None = None,
        softcap: float | None = None,
        z_loss: float = 0.0,
        return_token_accuracy: bool = False,
        impl: str | None = None,
    ) -> None:
        super().__init__()
        _check_loss_options(type(self).__name__, ignore_index, label_smoothing, reduction)
        _check_ce_extras(type(self).__name__, softcap, z_loss)
        if not isinstance(return_token_accuracy, bool):
            from .ops import _checks

            raise _checks.OpTypeError(type(self).__name__, "return_token_accuracy", f"expected a bool, got {return_token_accuracy!r}")
        self.ignore_index = ignore_index
        self.label_smoothing = label_smoothing
        self.reduction = reduction
        self.register_buffer("ce_weight", ce_weight)
        self.softcap = softcap
        self.z_loss = z_loss
        self.return_token_accuracy = return_token_accuracy
        self.impl = _check_impl(type(self).__name__, impl)

    def forward(
        self, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # Unflattened: the op takes any leading shape and checks target against it.
        return polykernel.fused_linear_cross_entropy(
            hidden,
            weight,
            target,
            bias,
            ignore_index=self.ignore_index,
            label_smoothing=self.label_smoothing,
            reduction=self.reduction,
            ce_weight=self.ce_weight,
            softcap=self.softcap,
            z_loss=self.z_loss,
            return_token_accuracy=self.return_token_accuracy,
            impl=self.impl,
        )

    def extra_repr(self) -> str:
        return (
            f"ignore_index={self.ignore_index}, label_smoothing={self.label_smoothing}, reduction={self.reduction!r}"
            + _extras_repr(self.softcap, self.z_loss, self.ce_weight is not None)
            + (", return_token_accuracy=True" if self.return_token_accuracy else "")
            + _impl_repr(self.impl)
        )


# -- distillation losses ---------------------------------------------------------------------------


def _check_distill_options(cls: str, **options: object) -> None:
    """The distillation losses' option checks, at construction (errors name the module)."""
    from .ops import _checks, _distill

    if "reduction" in options:
        _checks.choice(cls, "reduction", options["reduction"], ("batchmean", "sum", "mean", "none"))
    if "log_target" in options:
        _checks.boolean(cls, "log_target", options["log_target"])
    if "beta" in options:
        _distill.validate_beta(cls, options["beta"])
    if "ignore_index" in options:
        _checks.ignore_index(cls, options["ignore_index"], "labels", None)  # the labels' dtype: checked per call
    if "temperature" in options:
        _checks.positive_float(cls, "temperature", options["temperature"])
        _checks.finite_float(cls, "temperature", options["temperature"])


class KLDivLoss(nn.Module):
    """``torch.nn.KLDivLoss`` (``input``: log-probs) with an fp32 result; ``reduction`` defaults
    to ``"batchmean"`` (the mathematically right one; Liger's default too).

    >>> import torch, polykernel.nn as pnn
    >>> loss_fn = pnn.KLDivLoss(log_target=True)
    >>> s, t = torch.randn(3, 7).log_softmax(-1), torch.randn(3, 7).log_softmax(-1)
    >>> loss_fn(s, t).shape
    torch.Size([])
    """

    def __init__(self, reduction: str = "batchmean", log_target: bool = False, *, impl: str | None = None) -> None:
        super().__init__()
        _check_distill_options(type(self).__name__, reduction=reduction, log_target=log_target)
        self.reduction = reduction
        self.log_target = log_target
        self.impl = _check_impl(type(self).__name__, impl)

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return polykernel.kl_div(input, target, log_target=self.log_target, reduction=self.reduction, impl=self.impl)

    def extra_repr(self) -> str:
        return f"reduction={self.reduction!r}, log_target={self.log_target}" + _impl_repr(self.impl)


class JSDLoss(nn.Module):
    """Generalized Jensen-Shannon divergence between student and teacher log-probs ``[..., V]``
    (Liger's ``LigerJSD``): ``beta`` 0 is forward KL(teacher‖student), 1 reverse KL; rows whose
    ``labels`` entry is ``ignore_index`` are skipped.

    >>> import torch, polykernel.nn as pnn
    >>> loss_fn = pnn.JSDLoss(beta=0.5)
    >>> s, t = torch.randn(2, 4, 9).log_softmax(-1), torch.randn(2, 4, 9).log_softmax(-1)
    >>> loss_fn(s, t, torch.tensor([[1, 2, -100, 3], [0, 1, 2, 3]])).shape
    torch.Size([])
    """

    def __init__(self, beta: float = 0.5, ignore_index: int = -100, *, impl: str | None = None) -> None:
        super().__init__()
        _check_distill_options(type(self).__name__, beta=beta, ignore_index=ignore_index)
        self.beta = beta
        self.ignore_index = ignore_index
        self.impl = _check_impl(type(self).__name__, impl)

    def forward(self, student_logp: torch.Tensor, teacher_logp: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        return polykernel.jsd(student_logp, teacher_logp, labels, beta=self.beta, ignore_index=self.ignore_index, impl=self.impl)

    def extra_repr(self) -> str:
        return f"beta={self.beta}, ignore_index={self.ignore_index}" + _impl_repr(self.impl)


class TVDLoss(nn.Module):
    """Total variation distance ``0.5·Σ|p - q|`` between distributions ``[..., V]`` (Liger's
    ``LigerTVDLoss``); rows whose ``labels`` entry is ``ignore_index`` are skipped.

    >>> import torch, polykernel.nn as pnn
    >>> p, q = torch.randn(3, 7).softmax(-1), torch.randn(3, 7).softmax(-1)
    >>> pnn.TVDLoss()(p, q).shape
    torch.Size([])
    """

    def __init__(self, reduction: str = "batchmean", ignore_index: int = -100, *, impl: str | None = None) -> None:
        super().__init__()
        _check_distill_options(type(self).__name__, reduction=reduction, ignore_index=ignore_index)
        self.reduction = reduction
        self.ignore_index = ignore_index
        self.impl = _check_impl(type(self).__name__, impl)

    def forward(self, p: torch.Tensor, q: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        return polykernel.tvd(p, q, labels, reduction=self.reduction, ignore_index=self.ignore_index, impl=self.impl)

    def extra_repr(self) -> str:
        return f"reduction={self.reduction!r}, ignore_index={self.ignore_index}" + _impl_repr(self.impl)


class FusedLinearJSDLoss(nn.Module):
    """``JSDLoss`` of the student's and the teacher's LM heads without materializing either
    logits (Liger's ``LigerFusedLinearJSD``): ``forward(student_hidden [..., H], student_weight
    [V, H], teacher_hidden [..., Ht], teacher_weight [V, Ht], labels=None)``. The heads' weights
    are passed in (the module owns no parameters); only the student's receive gradients.

    >>> import torch, polykernel.nn as pnn
    >>> student, teacher = torch.nn.Linear(16, 50, bias=False), torch.nn.Linear(32, 50, bias=False)
    >>> loss_fn = pnn.FusedLinearJSDLoss(beta=0.5, temperature=2.0)
    >>> loss = loss_fn(torch.randn(2, 3, 16), student.weight, torch.randn(2, 3, 32), teacher.weight)
    >>> loss.backward()  # gradients reach the student's head only
    >>> student.weight.grad.shape, teacher.weight.grad
    (torch.Size([50, 16]), None)
    """

    def __init__(self, beta: float = 0.5, ignore_index: int = -100, temperature: float = 1.0, *, impl: str | None = None) -> None:
        super().__init__()
        _check_distill_options(type(self).__name__, beta=beta, ignore_index=ignore_index, temperature=temperature)
        self.beta = beta
        self.ignore_index = ignore_index
        self.temperature = temperature
        self.impl = _check_impl(type(self).__name__, impl)

    def forward(
        self,
        student_hidden: torch.Tensor,
        student_weight: torch.Tensor,
        teacher_hidden: torch.Tensor,
        teacher_weight: torch.Tensor,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return polykernel.fused_linear_jsd(
            student_hidden,
            student_weight,
            teacher_hidden,
            teacher_weight,
            labels,
            beta=self.beta,
            ignore_index=self.ignore_index,
            temperature=self.temperature,
            impl=self.impl,
        )

    def extra_repr(self) -> str:
        return f"beta={self.beta}, ignore_index={self.ignore_index}, temperature={self.temperature}" + _impl_repr(self.impl)


# -- preference and RL losses fused with the LM head ----------------------------------------------


class _FusedLinearPreferenceLoss(nn.Module):
    """A module over one ``polykernel.fused_linear_*_loss``: it keeps the loss's options (passed
    as keywords on every call) and owns no parameters (the LM head's weight is passed in)."""

    _fn: str  # the public function's name
    _options: ClassVar[dict[str, object]]  # option name -> default, in the function's order

    def __init__(self, *, impl: str | None = None, **options: object) -> None:
        super().__init__()
        unknown = set(options) - set(self._options)
        if unknown:
            raise TypeError(f"{type(self).__name__}: unknown option(s) {sorted(unknown)}; known: {list(self._options)}")
        self.options = {**self._options, **options}
        self.impl = _check_impl(type(self).__name__, impl)

    def forward(self, *args: torch.Tensor | None, **kwargs: torch.Tensor | None):  # returns the function's NamedTuple
        return getattr(polykernel, self._fn)(*args, **kwargs, **self.options, impl=self.impl)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items()) + _impl_repr(self.impl)


class FusedLinearDPOLoss(_FusedLinearPreferenceLoss):
    """``polykernel.fused_linear_dpo_loss`` as a module (Liger's ``LigerFusedLinearDPOLoss``):
    ``forward(hidden [2B, T, H], weight [V, H], target [2B, T], bias=None, *, ref_hidden=None,
    ref_weight=None, ref_bias=None, ref_chosen_logps=None, ref_rejected_logps=None)`` returns
    ``DPOOutput(loss, chosen_logps, rejected_logps, chosen_rewards, rejected_rewards, nll_loss)``.

    >>> import torch, polykernel.nn as pnn
    >>> head = torch.nn.Linear(16, 50, bias=False)
    >>> out = pnn.FusedLinearDPOLoss(beta=0.1)(torch.randn(4, 5, 16), head.weight, torch.randint(0, 50, (4, 5)))
    >>> out.loss.backward(); head.weight.grad.shape
    torch.Size([50, 16])
    """

    _fn = "fused_linear_dpo_loss"
    _options: ClassVar[dict[str, object]] = {"beta": 0.1, "ignore_index": -100, "average_log_prob": False, "compute_nll_loss": False}


class FusedLinearGRPOLoss(_FusedLinearPreferenceLoss):
    """``polykernel.fused_linear_grpo_loss`` as a module (Liger's ``LigerFusedLinearGRPOLoss``):
    ``forward(hidden [B, T, H], weight [V, H], selected_token_ids [B, T], attention_mask [B, T],
    advantages [B], bias=None, *, ref_per_token_logps=None, old_per_token_logps=None)`` returns
    ``GRPOOutput(loss, metrics)``.

    >>> import torch, polykernel.nn as pnn
    >>> head = torch.nn.Linear(16, 50, bias=False)
    >>> ids, mask = torch.randint(0, 50, (2, 5)), torch.ones(2, 5)
    >>> out = pnn.FusedLinearGRPOLoss(beta=0.0)(torch.randn(2, 5, 16), head.weight, ids, mask, torch.tensor([1.0, -1.0]))
    >>> out.loss.backward(); head.weight.grad.shape
    torch.Size([50, 16])
    """

    _fn = "fused_linear_grpo_loss"
    _options: ClassVar[dict[str, object]] = {
        "beta": 0.04, "epsilon_low": 0.2, "epsilon_high": 0.2, "loss_type": "grpo", "importance_sampling_level": "token",
        "temperature": 1.0, "max_completion_length": None, "use_bias_correction_kl": False,
    }  # fmt: skip


class FusedLinearORPOLoss(_FusedLinearPreferenceLoss):
    """``polykernel.fused_linear_orpo_loss`` as a module (Liger's ``LigerFusedLinearORPOLoss``):
    ``forward(hidden [2B, T, H], weight [V, H], target [2B, T], bias=None)`` returns ``ORPOOutput``.

    >>> import torch, polykernel.nn as pnn
    >>> out = pnn.FusedLinearORPOLoss(beta=0.1)(torch.randn(4, 5, 16), torch.randn(50, 16), torch.randint(0, 50, (4, 5)))
    >>> out._fields[:3]
    ('loss', 'chosen_logps', 'rejected_logps')
    """

    _fn = "fused_linear_orpo_loss"
    _options: ClassVar[dict[str, object]] = {"beta": 0.1, "ignore_index": -100, "compute_nll_loss": True}


class FusedLinearCPOLoss(_FusedLinearPreferenceLoss):
    """``polykernel.fused_linear_cpo_loss`` as a module (Liger's ``LigerFusedLinearCPOLoss``):
    ``forward(hidden [2B, T, H], weight [V, H], target [2B, T], bias=None)`` returns ``CPOOutput``."""

    _fn = "fused_linear_cpo_loss"
    _options: ClassVar[dict[str, object]] = {
        "beta": 0.1, "alpha": 1.0, "label_smoothing": 0.0, "ignore_index": -100, "average_log_prob": False,
    }  # fmt: skip


class FusedLinearSimPOLoss(_FusedLinearPreferenceLoss):
    """``polykernel.fused_linear_simpo_loss`` as a module (Liger's ``LigerFusedLinearSimPOLoss``):
    ``forward(hidden [2B, T, H], weight [V, H], target [2B, T], bias=None)`` returns ``SimPOOutput``."""

    _fn = "fused_linear_simpo_loss"
    _options: ClassVar[dict[str, object]] = {"beta": 2.0, "gamma": 0.5, "label_smoothing": 0.0, "ignore_index": -100}


class FusedLinearKTOLoss(_FusedLinearPreferenceLoss):
    """``polykernel.fused_linear_kto_loss`` as a module (Liger's ``LigerFusedLinearKTOLoss``):
    ``forward(hidden [B, T, H], weight [V, H], target [B, T], preference_labels [B], bias=None, *,
    ref_hidden=None, ref_weight=None, ref_bias=None, ref_logps=None, kl=None)`` returns ``KTOOutput``."""

    _fn = "fused_linear_kto_loss"
    _options: ClassVar[dict[str, object]] = {"beta": 0.1, "ignore_index": -100, "average_log_prob": False}
