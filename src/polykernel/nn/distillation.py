"""Distillation losses: KLDivLoss, JSDLoss, TVDLoss, and FusedLinearJSDLoss with the LM head."""

from __future__ import annotations

import torch
from torch import nn

import polykernel

from ._common import _check_impl, _impl_repr


def _check_distill_options(cls: str, **options: object) -> None:
    """The distillation losses' option checks, at construction (errors name the module)."""
    from ..ops import _checks, _distill

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
    to ``"batchmean"`` (the mathematically right one: the sum over ``input.size(0)``, as torch's),
    where ``torch.nn.KLDivLoss`` and Liger's ``LigerKLDIVLoss`` default to ``"mean"`` (the mean
    over every element): pass ``reduction="mean"`` to match them.

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
