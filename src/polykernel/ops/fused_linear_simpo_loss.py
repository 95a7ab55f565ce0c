"""``loss.fused_linear_simpo_loss``: SimPO's loss fused with the LM head (Liger's
``LigerFusedLinearSimPOLoss``, TRL's ``CPOTrainer`` ``loss_type="simpo"``), the ``[N, V]``
logits never held for the whole batch.

``hidden [2B, T, H]``, ``target [2B, T]``: B chosen rows, then B rejected. With ``c, r`` the
sequences' average log-probs and ε = ``label_smoothing``::

    loss = mean over pairs of −(1−ε)·logσ(β(c − r) − γ) − ε·logσ(−(β(c − r) − γ))

Rewards ``β·c``, ``β·r``. A sequence with no scored token has a NaN mean, so a NaN loss.
Impls and chunking as ``polykernel.fused_linear_dpo_loss``'s.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import torch

from ..core.op import Case, Op
from . import _autocast
from . import _checks as check
from . import _preference as pref
from ._preference_error import error_model_for
from .fused_linear_cpo_loss import sigmoid_terms

OP_ID = "loss.fused_linear_simpo_loss"


_op: Op  # defined below, after the public function it serves (with _dispatch, its dispatch)


class SimPOOutput(NamedTuple):
    loss: torch.Tensor
    chosen_logps: torch.Tensor  # [B], average log-probs
    rejected_logps: torch.Tensor
    chosen_rewards: torch.Tensor  # [B], β·c
    rejected_rewards: torch.Tensor


def contrib(logp, mask, *, beta: float, gamma: float, eps: float, n_pairs: int) -> torch.Tensor:
    c, r = pref.pair_logps(logp, mask, True)
    return sigmoid_terms(beta * (c - r) - gamma, eps) / n_pairs


def _setup(target, beta, gamma, label_smoothing, ignore_index):
    mask = target != ignore_index
    return mask, partial(contrib, beta=float(beta), gamma=float(gamma), eps=float(label_smoothing), n_pairs=target.shape[0] // 2)


def _stats(loss, logps, mask, beta) -> SimPOOutput:
    return SimPOOutput(*pref.pair_stats(loss, logps, mask, beta, True))


def fused_linear_simpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    beta: float = 2.0,
    gamma: float = 0.5,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    impl: str | None = None,
) -> SimPOOutput:
    """SimPO loss of an LM head over ``[chosen; rejected]`` sequences, without ``[N, V]`` logits.

    >>> import torch, polykernel
    >>> h, w = torch.randn(4, 5, 16, requires_grad=True), torch.randn(50, 16)
    >>> out = polykernel.fused_linear_simpo_loss(h, w, torch.randint(0, 50, (4, 5)), gamma=0.3)
    >>> out.loss.backward(); h.grad.shape
    torch.Size([4, 5, 16])
    """
    args = (hidden, weight, target, bias, beta, gamma, label_smoothing, ignore_index)
    _validate(*args)  # every call: the token ids' range is data
    if _any_autocast():  # the heads as F.linear there, every impl alike (ops._autocast)
        return _autocast.dispatch(_op, _dispatch, impl, args)
    return _dispatch(impl, *args)


def validate_options(op: str, *, beta=2.0, gamma=0.5, label_smoothing=0.0, ignore_index=-100) -> None:
    """The options' own checks (no tensor needed): every call, and ``nn.FusedLinearSimPOLoss``'s
    constructor (``ignore_index`` against the target's dtype: per call)."""
    pref.validate_beta(op, beta)
    check.ignore_index(op, ignore_index, "target", None)
    check.finite_float(op, "gamma", gamma)
    pref.validate_smoothing(op, label_smoothing)


def _validate(hidden, weight, target, bias, beta, gamma, label_smoothing, ignore_index) -> None:
    pref.validate_pairwise(OP_ID, hidden, weight, target, bias, beta, ignore_index)
    validate_options(OP_ID, gamma=gamma, label_smoothing=label_smoothing)  # beta, ignore_index: validate_pairwise


def chunked(head: pref.Head, hidden, weight, target, bias, beta, gamma, label_smoothing, ignore_index) -> SimPOOutput:
    """The loss through ``head``, the calling impl's chunked linear + log-prob machinery."""
    mask, fn = _setup(target, beta, gamma, label_smoothing, ignore_index)
    loss, logps = head.run(hidden, weight, bias, target, ignore_index, 1.0, True, fn, (mask,))
    return _stats(loss, logps, mask, float(beta))


def reference(hidden, weight, target, bias=None, beta=2.0, gamma=0.5, label_smoothing=0.0, ignore_index=-100) -> SimPOOutput:
    """The semantics in float64 from the full ``[2B, T, V]`` logits (differentiable)."""
    mask, fn = _setup(target, beta, gamma, label_smoothing, ignore_index)
    loss, logps = pref.reference_run(hidden, weight, bias, target, ignore_index, fn, (mask,))
    return pref.contract(_stats(loss, logps, mask, float(beta)), hidden)


error_model = error_model_for(reference, {"hidden": 0, "weight": 1, "bias": 3})


outputs = pref.pair_outputs(0)  # the first-call check: loss, the [B] log-probs and rewards
example = pref.pair_example


def cases(device, dtype, large: bool = False) -> list[Case]:
    """Awkward shapes and every option, sized for the CPU interpreter unless ``large``."""
    head = partial(pref.case_head, device=device, dtype=dtype)
    h, w, t, bias = head(4, 6, 16, 97)
    out = [
        Case("4x6x16x97", (h, w, t, bias)),
        Case("2x1x8x1-nobias", head(2, 1, 8, 1)[:3]),
        Case("4x6x16x97-gamma-smooth", (h, w, t, bias), {"gamma": 0.8, "label_smoothing": 0.1}),
        Case("6x5x24x300-beta", head(6, 5, 24, 300), {"beta": 0.5}),
    ]
    if large:
        out.append(example(pref.LARGE_SHAPE, dtype, device, True))
    return out


flops = pref.flops
bytes_moved = pref.bytes_moved


_op = Op(OP_ID, validate=_validate, reference=reference, autocast=_autocast.head_args(reference), outputs=outputs, error_model=error_model, cases=cases, example=example,
         **pref.op_fields(reference))  # impls: the backends' manifests (polykernel.backends)  # fmt: skip
_dispatch = _op.dispatch  # bound once
_any_autocast = _autocast.any_autocast
