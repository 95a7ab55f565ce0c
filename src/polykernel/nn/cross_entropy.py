"""Cross-entropy losses: CrossEntropyLoss, and FusedLinearCrossEntropyLoss with the LM head."""

from __future__ import annotations

import torch
from torch import nn

import polykernel

from ._common import _check_impl, _impl_repr


def _check_loss_options(cls: str, ignore_index: int, label_smoothing: float, reduction: str, weight: str = "weight") -> None:
    """The loss ops' own option checks, at construction (errors name the module)."""
    from ..ops import _checks
    from ..ops.cross_entropy import validate_options

    if isinstance(ignore_index, torch.Tensor):  # torch's and Liger's modules take the weights first
        raise _checks.OpTypeError(
            cls, "ignore_index", f"got a tensor: class weights are the keyword {weight}= here (the first positional is ignore_index)"
        )
    validate_options(cls, ignore_index, label_smoothing, reduction)


def _check_ce_extras(cls: str, softcap: float | None, z_loss: float) -> None:
    """softcap and z_loss, at construction (the weights are checked against the logits per call)."""
    from ..ops import _checks

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
    Liger's module takes ``(lin_weight, _input, target)``: the order differs (``hidden`` first).

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
        _check_loss_options(type(self).__name__, ignore_index, label_smoothing, reduction, "ce_weight")
        _check_ce_extras(type(self).__name__, softcap, z_loss)
        if not isinstance(return_token_accuracy, bool):
            from ..ops import _checks

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
