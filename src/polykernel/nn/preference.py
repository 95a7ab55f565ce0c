"""Preference and RL losses fused with the LM head: DPO, GRPO, ORPO, CPO, SimPO, KTO."""

from __future__ import annotations

import importlib
from typing import ClassVar

import torch
from torch import nn

import polykernel

from ._common import _check_impl, _impl_repr


class _FusedLinearPreferenceLoss(nn.Module):
    """A module over one ``polykernel.fused_linear_*_loss``: it keeps the loss's options (passed
    as keywords on every call) and owns no parameters (the LM head's weight is passed in).

    ``forward`` takes ``hidden`` first, then the head's ``weight`` (Liger's DPO, ORPO, CPO and
    SimPO modules take the weight first; swapped, the shape checks refuse the call).
    Each option is also an attribute, as on Liger's modules: ``loss_fn.beta = 0.2`` is checked
    and used by the next call (``options`` holds them: one place, read by ``forward``)."""

    _fn: str  # the public function's name
    _options: ClassVar[dict[str, object]]  # option name -> default, in the function's order

    def __init__(self, *, impl: str | None = None, **options: object) -> None:
        super().__init__()
        unknown = set(options) - set(self._options)
        if unknown:
            raise TypeError(f"{type(self).__name__}: unknown option(s) {sorted(unknown)}; known: {list(self._options)}")
        self._validate({**self._options, **options})
        self.options = {**self._options, **options}
        self.impl = _check_impl(type(self).__name__, impl)

    def _validate(self, options: dict[str, object]) -> None:
        """The op's own option checks, at construction and on each option set (errors name the module)."""
        importlib.import_module(f"polykernel.ops.{self._fn}").validate_options(type(self).__name__, **options)

    def __getattr__(self, name: str) -> object:
        options = self.__dict__.get("options")  # absent while unpickling: no recursion
        if options is not None and name in options:
            return options[name]
        return super().__getattr__(name)

    def __setattr__(self, name: str, value: object) -> None:
        # an option set as an attribute would otherwise sit beside ``options``, read by nothing
        if name in type(self)._options and "options" in self.__dict__:
            self._validate({**self.options, name: value})
            self.options[name] = value
        else:
            super().__setattr__(name, value)

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
    ``GRPOOutput(loss, metrics)``. ``loss_type`` defaults to ``"grpo"``; Liger's module (and TRL's
    config) default to ``'dapo'``: pass it to match them.

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
    ``forward(hidden [2B, T, H], weight [V, H], target [2B, T], bias=None)`` returns ``CPOOutput``.

    >>> import torch, polykernel.nn as pnn
    >>> h = torch.randn(4, 5, 16, requires_grad=True)  # 2 chosen rows, then 2 rejected
    >>> out = pnn.FusedLinearCPOLoss(beta=0.1, alpha=1.0)(h, torch.randn(50, 16), torch.randint(0, 50, (4, 5)))
    >>> out.loss.backward(); h.grad.shape
    torch.Size([4, 5, 16])
    """

    _fn = "fused_linear_cpo_loss"
    _options: ClassVar[dict[str, object]] = {
        "beta": 0.1, "alpha": 1.0, "label_smoothing": 0.0, "ignore_index": -100, "average_log_prob": False,
    }  # fmt: skip


class FusedLinearSimPOLoss(_FusedLinearPreferenceLoss):
    """``polykernel.fused_linear_simpo_loss`` as a module (Liger's ``LigerFusedLinearSimPOLoss``):
    ``forward(hidden [2B, T, H], weight [V, H], target [2B, T], bias=None)`` returns ``SimPOOutput``.
    Two defaults differ from Liger's module: ``beta`` is 2.0 (the SimPO paper's; Liger's 0.1), and
    there is no NLL term (Liger's ``compute_nll_loss`` defaults to True, adding ``alpha``·NLL of
    the chosen sequences to the loss).

    >>> import torch, polykernel.nn as pnn
    >>> out = pnn.FusedLinearSimPOLoss(beta=2.0, gamma=0.5)(torch.randn(4, 5, 16), torch.randn(50, 16), torch.randint(0, 50, (4, 5)))
    >>> out.loss.shape
    torch.Size([])
    """

    _fn = "fused_linear_simpo_loss"
    _options: ClassVar[dict[str, object]] = {"beta": 2.0, "gamma": 0.5, "label_smoothing": 0.0, "ignore_index": -100}


class FusedLinearKTOLoss(_FusedLinearPreferenceLoss):
    """``polykernel.fused_linear_kto_loss`` as a module (Liger's ``LigerFusedLinearKTOLoss``):
    ``forward(hidden [B, T, H], weight [V, H], target [B, T], preference_labels [B], bias=None, *,
    ref_hidden=None, ref_weight=None, ref_bias=None, ref_logps=None, kl=None)`` returns ``KTOOutput``.

    >>> import torch, polykernel.nn as pnn
    >>> labels = torch.tensor([True, False, True])  # desirable or not, per sequence
    >>> out = pnn.FusedLinearKTOLoss(beta=0.1)(torch.randn(3, 5, 16), torch.randn(50, 16), torch.randint(0, 50, (3, 5)), labels, kl=0.1)
    >>> out.chosen_logps.shape, out.rejected_logps.shape
    (torch.Size([2]), torch.Size([1]))
    """

    _fn = "fused_linear_kto_loss"
    _options: ClassVar[dict[str, object]] = {"beta": 0.1, "ignore_index": -100, "average_log_prob": False}
