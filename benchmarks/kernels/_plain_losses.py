"""The post-training losses as one writes them without a kernel library (TRL-style): the whole
``[N, V]`` logits (or the given log-probs) upcast to fp32, then the loss formula. The baseline rows
of ``post_training_losses.py``; each formula is polykernel's op at the arguments that script
passes (its docstring), so the values compare."""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F


@functools.cache
def _selective_log_softmax():
    # imported on first use: ``trl.trainer.utils`` takes ~5 s to import, which a run that exits on
    # a bad option (and each ``--tiny`` test of the script) would pay for nothing
    try:
        from trl.trainer.utils import selective_log_softmax
    except ImportError:  # TRL not installed: its naive equivalent
        return lambda logits, index: logits.log_softmax(-1).gather(-1, index[..., None]).squeeze(-1)
    return selective_log_softmax


def selective_log_softmax(logits, index):
    """TRL's ``selective_log_softmax`` (its naive equivalent without TRL)."""
    return _selective_log_softmax()(logits, index)


IGNORE = -100


def token_logps(hidden, weight, target):
    """TRL's way: the whole [R, T, V] logits in the inputs' dtype, then log-softmax + gather (fp32)."""
    valid = target != IGNORE
    lp = selective_log_softmax((hidden @ weight.T).float(), torch.where(valid, target, 0))
    return torch.where(valid, lp, 0.0), valid


def seq_logps(hidden, weight, target, average=False):
    """(per-sequence log-prob sums, or means over the scored tokens; token log-probs; scored mask)."""
    lp, valid = token_logps(hidden, weight, target)
    seq = lp.sum(-1)
    return (seq / valid.sum(-1) if average else seq), lp, valid


def chosen_nll(lp, valid):
    """The chosen half's token-mean NLL."""
    b = lp.shape[0] // 2
    return -lp[:b].sum() / valid[:b].sum()


def dpo(hidden, weight, target, beta=0.1):
    seq, _, _ = seq_logps(hidden, weight, target)
    c, r = seq.chunk(2)
    return -F.logsigmoid(beta * (c - r)).mean()


def orpo(hidden, weight, target, beta=0.1):
    avg, lp, valid = seq_logps(hidden, weight, target, average=True)
    c, r = avg.chunk(2)
    log_odds = (c - r) - (torch.log1p(-torch.exp(c)) - torch.log1p(-torch.exp(r)))
    return chosen_nll(lp, valid) - beta * F.logsigmoid(log_odds).mean()


def cpo(hidden, weight, target, beta=0.1, alpha=1.0):
    seq, lp, valid = seq_logps(hidden, weight, target)
    c, r = seq.chunk(2)
    return -F.logsigmoid(beta * (c - r)).mean() + alpha * chosen_nll(lp, valid)


def simpo(hidden, weight, target, beta=2.0, gamma=0.5):
    avg, _, _ = seq_logps(hidden, weight, target, average=True)
    c, r = avg.chunk(2)
    return -F.logsigmoid(beta * (c - r) - gamma).mean()


def kto(hidden, weight, target, desirable, beta=0.1):
    """No reference (log-ratio = log-prob) and KL 0, as the script calls polykernel's."""
    seq, _, _ = seq_logps(hidden, weight, target)
    sign = torch.where(desirable, 1.0, -1.0)
    return (1 - torch.sigmoid(beta * seq * sign)).mean()


def grpo(hidden, weight, ids, mask, adv, ref, old, beta=0.04, eps=0.2):
    lp, _ = token_logps(hidden, weight, ids)
    coef_1 = torch.exp(lp - old)
    coef_2 = coef_1.clamp(1 - eps, 1 + eps)
    a = adv[:, None]
    ptl = -torch.min(coef_1 * a, coef_2 * a) + beta * (torch.exp(ref - lp) - (ref - lp) - 1)
    m = mask.float()
    return ((ptl * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()


def kl_div(logp, p):
    return F.kl_div(logp.float(), p.float(), reduction="batchmean")


def _scored_mean(rows, labels):
    valid = labels != IGNORE
    return torch.where(valid, rows, 0.0).sum() / valid.sum()


def jsd(student_logp, teacher_logp, labels):
    """β = 0.5: the mean over scored rows of ½·KL(P‖M) + ½·KL(Q‖M), M = ½(P + Q)."""
    s, t = student_logp.float(), teacher_logp.float()
    m = torch.logaddexp(s, t) - math.log(2.0)
    rows = 0.5 * (t.exp() * (t - m)).sum(-1) + 0.5 * (s.exp() * (s - m)).sum(-1)
    return _scored_mean(rows, labels)


def tvd(p, q, labels):
    return _scored_mean(0.5 * (p.float() - q.float()).abs().sum(-1), labels)


def fused_linear_jsd(student_hidden, student_weight, teacher_hidden, teacher_weight, labels):
    s = (student_hidden @ student_weight.T).float().log_softmax(-1)
    t = (teacher_hidden @ teacher_weight.T).float().log_softmax(-1)
    return jsd(s, t, labels)


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    softcap: float | None = None,
    z_loss: float = 0.0,
    weight: torch.Tensor | None = None,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Hugging Face's way (the logits upcast, then ``F.cross_entropy``) with the options written out
    in torch, as ``polykernel.cross_entropy`` defines them: the softcap on the upcast logits, then
    the z-loss ``z_loss·lse²`` per scored row, weighted by ``w[t]`` and reduced like the loss (over
    the summed ``w[t]``; the count without class weights)."""
    x = logits.float()
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    loss = F.cross_entropy(x, target, weight=weight, ignore_index=IGNORE, label_smoothing=label_smoothing)
    if z_loss:
        valid = target != IGNORE
        w_t = valid.float() if weight is None else torch.where(valid, weight[torch.where(valid, target, 0)], 0.0)
        loss = loss + z_loss * (w_t * torch.logsumexp(x, -1).square()).sum() / w_t.sum()
    return loss


def fused_linear_cross_entropy(hidden: torch.Tensor, head: torch.Tensor, target: torch.Tensor, **options: object) -> torch.Tensor:
    """The ``[N, V]`` logits materialised by the LM head's matmul (in the inputs' dtype), then
    :func:`cross_entropy` (``options``: its keywords; ``weight`` is the class weights)."""
    return cross_entropy(hidden @ head.T, target, **options)
