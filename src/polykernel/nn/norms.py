"""Normalisation layers: RMSNorm (with the fused residual add), LayerNorm, GroupNorm, DyT, PolyNorm."""

from __future__ import annotations

import torch
from torch import nn

import polykernel

from ..ops import _checks
from ._common import _check_impl, _eps, _impl_repr, _number, _size


class RMSNorm(nn.Module):
    """RMSNorm over the last dim: ``x / sqrt(mean(x²) + eps) * (weight + offset)``.

    ``casting="fp32"`` matches ``torch.nn.RMSNorm`` (fp32 math, one cast at the end);
    ``"llama"`` matches Hugging Face Llama (normalized x cast to x.dtype before the weight).
    Gemma's ``x̂ · (1 + w)`` is ``offset=1.0``. The weight is initialized to ``1 - offset``, so a
    fresh module scales by one either way. ``eps=None`` (the default, as in ``torch.nn.RMSNorm``)
    is ``torch.finfo`` of the math's dtype per call: fp32's for fp16/bf16/fp32 inputs, fp64's for fp64.

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
        eps: float | None = None,
        *,
        offset: float = 0.0,
        casting: str = "fp32",
        impl: str | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.hidden_size = _size(type(self).__name__, "hidden_size", hidden_size)
        self.eps = None if eps is None else _eps(type(self).__name__, eps)
        self.offset = _number(type(self).__name__, "offset", offset)
        if casting not in ("fp32", "llama"):
            raise ValueError(f"RMSNorm: casting must be 'fp32' or 'llama', got {casting!r}")
        self.casting = casting
        self.impl = _check_impl(type(self).__name__, impl)
        self.weight = nn.Parameter(torch.empty(self.hidden_size, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.constant_(self.weight, 1.0 - self.offset)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # eps=None: torch.nn.RMSNorm's epsilon of its math dtype (fp32 for half types), per call
        eps = torch.finfo(torch.promote_types(x.dtype, torch.float32)).eps if self.eps is None else self.eps
        if residual is not None:
            if self.casting != "fp32":  # the fused op rounds like casting="fp32": add, then normalize
                s = x + residual
                return polykernel.rms_norm(s, self.weight, eps, offset=self.offset, casting=self.casting, impl=self.impl), s
            return polykernel.fused_add_rms_norm(x, residual, self.weight, eps, offset=self.offset, impl=self.impl)
        return polykernel.rms_norm(x, self.weight, eps, offset=self.offset, casting=self.casting, impl=self.impl)

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
        self.hidden_size = _size(type(self).__name__, "hidden_size", hidden_size)
        self.eps = _eps(type(self).__name__, eps)
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
        if self.weight is None and (x.dim() == 0 or x.shape[-1] != self.hidden_size):
            # with no weight the op cannot see the size: torch.nn.LayerNorm refuses such an x
            exc = _checks.OpArgumentError("LayerNorm", "x", f"expected a last dim of {self.hidden_size}, got shape {tuple(x.shape)}")
            if not torch.compiler.is_compiling():
                raise exc
            # raised in traced code, fullgraph reports only "Observed exception": a graph node
            # raises it when the graph runs, before the op (which takes any size without weight)
            from ..compile.runtime import _argument_error

            _argument_error(exc)
        return polykernel.layer_norm(x, self.weight, self.bias, self.eps, impl=self.impl)

    def extra_repr(self) -> str:
        return (
            f"({self.hidden_size},), eps={self.eps}, elementwise_affine={self.elementwise_affine}, bias={self.bias is not None}"
            + _impl_repr(self.impl)
        )


class GroupNorm(nn.Module):
    """GroupNorm of ``x [N, C, *]``, like ``torch.nn.GroupNorm(num_groups, num_channels)`` (fp32
    math); ``affine=False`` has no weight or bias, ``bias=False`` (torch 2.13's) no bias.

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
        bias: bool = True,
        impl: str | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.num_groups = _size(type(self).__name__, "num_groups", num_groups)
        self.num_channels = _size(type(self).__name__, "num_channels", num_channels)
        if self.num_channels % self.num_groups:
            raise ValueError(f"GroupNorm: num_groups {num_groups} must divide num_channels {num_channels}")
        self.eps = _eps(type(self).__name__, eps)
        self.affine = affine
        self.impl = _check_impl(type(self).__name__, impl)
        if affine:
            self.weight = nn.Parameter(torch.empty(self.num_channels, device=device, dtype=dtype))
            if bias:
                self.bias = nn.Parameter(torch.empty(self.num_channels, device=device, dtype=dtype))
            else:
                self.register_parameter("bias", None)
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
        return polykernel.group_norm(x, self.num_groups, self.weight, self.bias, self.eps, impl=self.impl)

    def extra_repr(self) -> str:
        no_bias = ", bias=False" if self.affine and self.bias is None else ""
        return f"{self.num_groups}, {self.num_channels}, eps={self.eps}, affine={self.affine}{no_bias}" + _impl_repr(self.impl)


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
        self.hidden_size = _size(type(self).__name__, "hidden_size", hidden_size)
        self.init_alpha = _init_alpha(init_alpha)
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

    # LigerDyT's names for weight and bias: its checkpoints load here (saved under ours)
    _LIGER_NAMES = (("gamma", "weight"), ("beta", "bias"))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        for theirs, ours in self._LIGER_NAMES:
            if prefix + theirs not in state_dict or getattr(self, ours) is None:
                continue  # (beta into a module without a bias stays an unexpected key)
            if prefix + ours in state_dict:
                error_msgs.append(f"DyT: both {prefix + theirs!r} (Liger's name) and {prefix + ours!r} are given")
                continue
            state_dict[prefix + ours] = state_dict.pop(prefix + theirs)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)

    def extra_repr(self) -> str:
        return f"({self.hidden_size},), init_alpha={self.init_alpha}, bias={self.bias is not None}" + _impl_repr(self.impl)


def _init_alpha(value: object) -> float:
    """DyT's ``init_alpha``: a finite number. A bool is Liger's ``LigerDyT(hidden_size, beta,
    init_alpha)`` order, whose second positional is the bias switch (ours is ``bias=``)."""
    if isinstance(value, bool):
        raise _checks.OpTypeError(
            "DyT", "init_alpha", f"got {value}: the bias switch is the keyword bias= here (Liger's DyT takes beta= second)"
        )
    return _number("DyT", "init_alpha", value)


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
        self.eps = _eps(type(self).__name__, eps)
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
