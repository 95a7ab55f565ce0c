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

from . import _checks as check
from . import _preference as pref

OP_ID = "loss.fused_linear_cpo_loss"


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
    k = logp.shape[0] // 2
    seq = pref.sequence_logps(logp, mask, average)
    terms = sigmoid_terms(beta * (seq[:k] - seq[k:]), eps) / n_pairs
    return terms if alpha == 0.0 else terms + alpha * pref.nll_terms(logp, nll_tokens)


def _setup(target, beta, alpha, label_smoothing, ignore_index, average):
    b = target.shape[0] // 2
    mask = target != ignore_index
    fn = partial(contrib, beta=float(beta), alpha=float(alpha), eps=float(label_smoothing), average=average, n_pairs=b,
                 nll_tokens=mask[:b].sum())  # fmt: skip
    return mask, fn


def _stats(loss, logps, mask, beta, average) -> CPOOutput:
    with torch.no_grad():
        b = mask.shape[0] // 2
        seq = pref.sequence_logps(logps, mask, average)
        c, r = seq[:b], seq[b:]
        return CPOOutput(loss, c, r, beta * c, beta * r, -logps[:b].sum() / mask[:b].sum())


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
    pref.validate_pairwise(OP_ID, hidden, weight, target, bias, beta, ignore_index)
    check.nonnegative_float(OP_ID, "alpha", alpha)
    check.finite_float(OP_ID, "alpha", alpha)
    pref.validate_smoothing(OP_ID, label_smoothing)
    if impl == "liger":
        return pref.liger(OP_ID).cpo(
            hidden, weight, target, bias, float(beta), float(alpha), float(label_smoothing), ignore_index, average_log_prob
        )
    mask, fn = _setup(target, beta, alpha, label_smoothing, ignore_index, average_log_prob)
    loss, logps = pref.run(OP_ID, impl, hidden, weight, bias, target, ignore_index, True, fn, (mask,))
    return _stats(loss, logps, mask, float(beta), average_log_prob)


def reference(hidden, weight, target, bias=None, *, beta=0.1, alpha=1.0, label_smoothing=0.0, ignore_index=-100,
              average_log_prob=False) -> CPOOutput:  # fmt: skip
    """The semantics in float64 from the full ``[2B, T, V]`` logits (differentiable)."""
    mask, fn = _setup(target, beta, alpha, label_smoothing, ignore_index, average_log_prob)
    loss, logps = pref.reference_run(hidden, weight, bias, target, ignore_index, fn, (mask,))
    return _stats(loss, logps, mask, float(beta), average_log_prob)
