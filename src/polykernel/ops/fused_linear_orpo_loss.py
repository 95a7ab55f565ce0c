"""``loss.fused_linear_orpo_loss``: ORPO's loss fused with the LM head (Liger's
``LigerFusedLinearORPOLoss``, TRL's ``ORPOTrainer``), the ``[N, V]`` logits never held for the
whole batch.

``hidden [2B, T, H]``, ``target [2B, T]``: B chosen rows, then B rejected. With ``c, r`` the
sequences' average log-probs (mean over scored tokens)::

    log_odds = (c − r) − (log1p(−e^c) − log1p(−e^r))
    loss     = NLL(chosen) − β · mean over pairs of logσ(log_odds)     (NLL with compute_nll_loss)

``nll_loss``: the chosen rows' token-mean NLL. Rewards ``β·c``, ``β·r``; ``log_odds_ratio`` the
mean of logσ(log_odds), ``log_odds_chosen`` the mean of log_odds. Impls and chunking as
``polykernel.fused_linear_dpo_loss``'s.
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
from ._preference_error import error_model_for, orpo_curv, orpo_gain

OP_ID = "loss.fused_linear_orpo_loss"


_op: Op  # defined below, after the public function it serves (with _dispatch, its dispatch)


class ORPOOutput(NamedTuple):
    loss: torch.Tensor
    chosen_logps: torch.Tensor  # [B], average log-probs
    rejected_logps: torch.Tensor
    chosen_rewards: torch.Tensor  # [B], β·c
    rejected_rewards: torch.Tensor
    nll_loss: torch.Tensor  # 0-d
    log_odds_ratio: torch.Tensor  # 0-d, mean of logσ(log_odds)
    log_odds_chosen: torch.Tensor  # 0-d, mean of log_odds


def log_odds(c: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    return (c - r) - (torch.log1p(-torch.exp(c)) - torch.log1p(-torch.exp(r)))


def contrib(logp, mask, *, beta: float, n_pairs: int, nll_tokens) -> torch.Tensor:
    terms = -beta * F.logsigmoid(log_odds(*pref.pair_logps(logp, mask, True))) / n_pairs
    return terms if nll_tokens is None else terms + pref.nll_terms(logp, nll_tokens)


def _setup(target, beta, ignore_index, compute_nll_loss):
    b = target.shape[0] // 2
    mask = target != ignore_index
    return mask, partial(contrib, beta=float(beta), n_pairs=b, nll_tokens=mask[:b].sum() if compute_nll_loss else None)


def _stats(loss, logps, mask, beta) -> ORPOOutput:
    stats = pref.pair_stats(loss, logps, mask, beta, True)  # loss, c, r, β·c, β·r
    with torch.no_grad():
        lo = log_odds(*stats[1:3])
        return ORPOOutput(*stats, pref.chosen_nll(logps, mask), F.logsigmoid(lo).mean(), lo.mean())


def fused_linear_orpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    beta: float = 0.1,
    ignore_index: int = -100,
    compute_nll_loss: bool = True,
    impl: str | None = None,
) -> ORPOOutput:
    """ORPO loss of an LM head over ``[chosen; rejected]`` sequences, without ``[N, V]`` logits.

    >>> import torch, polykernel
    >>> h, w = torch.randn(4, 5, 16, requires_grad=True), torch.randn(50, 16)
    >>> out = polykernel.fused_linear_orpo_loss(h, w, torch.randint(0, 50, (4, 5)))
    >>> out.loss.backward(); h.grad.shape
    torch.Size([4, 5, 16])
    """
    _validate(hidden, weight, target, bias, beta, ignore_index)  # every call: the token ids' range is data
    args = (hidden, weight, target, bias, beta, ignore_index, compute_nll_loss)
    if _any_autocast():  # the heads as F.linear there, every impl alike (ops._autocast)
        return _autocast.dispatch(_op, _dispatch, impl, args)
    return _dispatch(impl, *args)


def validate_options(op: str, *, beta=0.1, ignore_index=-100, compute_nll_loss=True) -> None:
    """The options' own checks (no tensor needed): ``nn.FusedLinearORPOLoss``'s constructor; each
    call checks them in ``_validate`` (``ignore_index`` against the target's dtype too)."""
    pref.validate_beta(op, beta)
    check.ignore_index(op, ignore_index, "target", None)
    check.boolean(op, "compute_nll_loss", compute_nll_loss)


def _validate(hidden, weight, target, bias, beta, ignore_index, *_: object) -> None:
    pref.validate_pairwise(OP_ID, hidden, weight, target, bias, beta, ignore_index)


def chunked(head: pref.Head, hidden, weight, target, bias, beta, ignore_index, compute_nll_loss) -> ORPOOutput:
    """The loss through ``head``, the calling impl's chunked linear + log-prob machinery."""
    mask, fn = _setup(target, beta, ignore_index, compute_nll_loss)
    loss, logps = head.run(hidden, weight, bias, target, ignore_index, 1.0, True, fn, (mask,))
    return _stats(loss, logps, mask, float(beta))


def reference(hidden, weight, target, bias=None, beta=0.1, ignore_index=-100, compute_nll_loss=True) -> ORPOOutput:
    """The semantics in float64 from the full ``[2B, T, V]`` logits (differentiable)."""
    mask, fn = _setup(target, beta, ignore_index, compute_nll_loss)
    loss, logps = pref.reference_run(hidden, weight, bias, target, ignore_index, fn, (mask,))
    return pref.contract(_stats(loss, logps, mask, float(beta)), hidden)


# ORPO's c, r are always the sequences' mean log-probs (pref.pair_logps(..., True)): average=True
error_model = error_model_for(reference, {"hidden": 0, "weight": 1, "bias": 3}, gain=orpo_gain, curv=orpo_curv, average=True)


outputs = pref.pair_outputs(3)  # the first-call check: loss, the [B] log-probs and rewards, nll_loss, the log-odds' two
example = pref.pair_example


def cases(device, dtype, large: bool = False) -> list[Case]:
    """Awkward shapes and every option, sized for the CPU interpreter unless ``large``."""
    head = partial(pref.case_head, device=device, dtype=dtype)
    h, w, t, bias = head(4, 6, 16, 97)
    out = [
        Case("4x6x16x97", (h, w, t, bias)),
        Case("2x1x8x1-nobias-nonll", head(2, 1, 8, 1)[:3], {"compute_nll_loss": False}),
        Case("4x6x16x97-beta", (h, w, t, bias), {"beta": 0.7}),
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
