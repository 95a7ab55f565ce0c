"""``loss.fused_linear_cpo_loss``: CPO's loss fused with the LM head (Liger's
``LigerFusedLinearCPOLoss``, TRL's ``CPOTrainer`` ``loss_type="sigmoid"``), the ``[N, V]``
logits never held for the whole batch.

``hidden [2B, T, H]``, ``target [2B, T]``: B chosen rows, then B rejected. With ``c, r`` the
sequences' log-probs (sums, or means with ``average_log_prob``) and ε = ``label_smoothing``::

    loss = mean over pairs of −(1−ε)·logσ(β(c − r)) − ε·logσ(−β(c − r))  +  α·NLL(chosen)

``nll_loss``: the chosen rows' token-mean NLL (NaN when none is scored; with α = 0 it is not
added). Rewards ``β·c``, ``β·r``. Impls and chunking as ``polykernel.fused_linear_dpo_loss``'s.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..core.op import Case, Op
from . import _autocast
from . import _checks as check
from . import _preference as pref
from ._preference_error import error_model_for

OP_ID = "loss.fused_linear_cpo_loss"


_op: Op  # defined below, after the public function it serves (with _dispatch, its dispatch)


class CPOOutput(NamedTuple):
    loss: torch.Tensor
    chosen_logps: torch.Tensor  # [B]
    rejected_logps: torch.Tensor
    chosen_rewards: torch.Tensor  # [B], β·c
    rejected_rewards: torch.Tensor
    nll_loss: torch.Tensor  # 0-d


def sigmoid_terms(z: torch.Tensor, eps: float) -> torch.Tensor:
    """``−(1−ε)·logσ(z) − ε·logσ(−z)``: the label-smoothed sigmoid loss of CPO and SimPO."""
    return -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)


def contrib(logp, mask, *, beta: float, alpha: float, eps: float, average: bool, n_pairs: int, nll_tokens) -> torch.Tensor:
    c, r = pref.pair_logps(logp, mask, average)
    terms = sigmoid_terms(beta * (c - r), eps) / n_pairs
    return terms if alpha == 0.0 else terms + alpha * pref.nll_terms(logp, nll_tokens)


def _setup(target, beta, alpha, label_smoothing, ignore_index, average):
    b = target.shape[0] // 2
    mask = target != ignore_index
    fn = partial(contrib, beta=float(beta), alpha=float(alpha), eps=float(label_smoothing), average=average, n_pairs=b,
                 nll_tokens=mask[:b].sum())  # fmt: skip
    return mask, fn


def _stats(loss, logps, mask, beta, average) -> CPOOutput:
    return CPOOutput(*pref.pair_stats(loss, logps, mask, beta, average), pref.chosen_nll(logps, mask))


def fused_linear_cpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    beta: float = 0.1,
    alpha: float = 1.0,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    average_log_prob: bool = False,
    impl: str | None = None,
) -> CPOOutput:
    """CPO loss of an LM head over ``[chosen; rejected]`` sequences, without ``[N, V]`` logits.

    >>> import torch, polykernel
    >>> h, w = torch.randn(4, 5, 16, requires_grad=True), torch.randn(50, 16)
    >>> out = polykernel.fused_linear_cpo_loss(h, w, torch.randint(0, 50, (4, 5)), alpha=0.5)
    >>> out.loss.backward(); h.grad.shape
    torch.Size([4, 5, 16])
    """
    args = (hidden, weight, target, bias, beta, alpha, label_smoothing, ignore_index, average_log_prob)
    _validate(*args)  # every call: the token ids' range is data
    if _any_autocast():  # the heads as F.linear there, every impl alike (ops._autocast)
        return _autocast.dispatch(_op, _dispatch, impl, args)
    return _dispatch(impl, *args)


def validate_options(op: str, *, beta=0.1, alpha=1.0, label_smoothing=0.0, ignore_index=-100, average_log_prob=False) -> None:
    """The options' own checks (no tensor needed): every call, and ``nn.FusedLinearCPOLoss``'s
    constructor (``ignore_index`` against the target's dtype: per call)."""
    pref.validate_beta(op, beta)
    check.ignore_index(op, ignore_index, "target", None)
    check.nonnegative_float(op, "alpha", alpha)
    check.finite_float(op, "alpha", alpha)
    pref.validate_smoothing(op, label_smoothing)
    check.boolean(op, "average_log_prob", average_log_prob)


def _validate(hidden, weight, target, bias, beta, alpha, label_smoothing, ignore_index, *_: object) -> None:
    pref.validate_pairwise(OP_ID, hidden, weight, target, bias, beta, ignore_index)
    validate_options(OP_ID, alpha=alpha, label_smoothing=label_smoothing)  # beta, ignore_index: validate_pairwise


def chunked(head: pref.Head, hidden, weight, target, bias, beta, alpha, label_smoothing, ignore_index, average_log_prob) -> CPOOutput:
    """The loss through ``head``, the calling impl's chunked linear + log-prob machinery."""
    mask, fn = _setup(target, beta, alpha, label_smoothing, ignore_index, average_log_prob)
    loss, logps = head.run(hidden, weight, bias, target, ignore_index, 1.0, True, fn, (mask,))
    return _stats(loss, logps, mask, float(beta), average_log_prob)


def reference(hidden, weight, target, bias=None, beta=0.1, alpha=1.0, label_smoothing=0.0, ignore_index=-100,
              average_log_prob=False) -> CPOOutput:  # fmt: skip
    """The semantics in float64 from the full ``[2B, T, V]`` logits (differentiable)."""
    mask, fn = _setup(target, beta, alpha, label_smoothing, ignore_index, average_log_prob)
    loss, logps = pref.reference_run(hidden, weight, bias, target, ignore_index, fn, (mask,))
    return pref.contract(_stats(loss, logps, mask, float(beta), average_log_prob), hidden)


error_model = error_model_for(reference, {"hidden": 0, "weight": 1, "bias": 3})


outputs = pref.pair_outputs(1)  # the first-call check: loss, the [B] log-probs and rewards, nll_loss
example = pref.pair_example


def cases(device, dtype, large: bool = False) -> list[Case]:
    """Awkward shapes and every option, sized for the CPU interpreter unless ``large``."""
    head = partial(pref.case_head, device=device, dtype=dtype)
    h, w, t, bias = head(4, 6, 16, 97)
    out = [
        Case("4x6x16x97", (h, w, t, bias)),
        Case("2x1x8x1-nobias", head(2, 1, 8, 1)[:3]),
        Case("4x6x16x97-alpha-smooth", (h, w, t, bias), {"alpha": 0.5, "label_smoothing": 0.1}),
        Case("4x6x16x97-avg-alpha0", (h, w, t, bias), {"average_log_prob": True, "alpha": 0.0, "beta": 0.5}),
        Case("6x5x24x300", head(6, 5, 24, 300)),
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
