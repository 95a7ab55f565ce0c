"""``loss.fused_linear_grpo_loss``: TRL's ``GRPOTrainer`` loss fused with the LM head (Liger's
``LigerFusedLinearGRPOLoss``), the ``[N, V]`` logits never held for the whole batch.

``hidden [B, T, H]`` are the completion tokens' hidden states, ``selected_token_ids [B, T]`` the
sampled tokens, ``attention_mask [B, T]`` which of them are scored (nonzero), ``advantages [B]``
one per sequence. With ``logps = log_softmax(hidden @ W.T + b) / temperature)[selected]`` and
``old = old_per_token_logps`` (else ``logps.detach()``)::

    r    = exp(logps − old)                      ("token"), or per sequence exp of the masked
                                                 mean of logps − old ("sequence")
    loss_t = −min(r·A, clamp(r, 1 − ε_low, 1 + ε_high)·A) + β·(exp(ref − logps) − (ref − logps) − 1)

reduced as TRL does: ``"grpo"`` the mean over sequences of each one's masked token mean (a
sequence with no scored token counts 0), ``"bnpo"``/``"dapo"`` the masked sum over the masked
count (clamped to 1, so an all-masked batch gives 0), ``"dr_grpo"`` the masked sum over
``B · max_completion_length`` (default T). Masked tokens take no part (``where``, not a product:
their ratios may overflow). ``metrics``: the masked means TRL logs (KL when β ≠ 0, the clipped
fractions; NaN for an all-masked batch). Gradients reach hidden, weight and bias through
``loss`` only. Impls: ``torch``, ``triton`` (the chunked driver,
``polykernel.backends.torch._linear_logps``; a chunk holds whole sequences, so the
sequence-level ratio never couples chunks), ``liger``.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import torch

from ..backends.torch import _linear_logps as walker
from . import _checks as check
from . import _preference as pref

OP_ID = "loss.fused_linear_grpo_loss"
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
IS_LEVELS = ("token", "sequence")
_IGNORE = -100  # the driver's marker of a masked token (token ids are >= 0)


class GRPOMetrics(NamedTuple):
    kl: torch.Tensor | None  # masked mean of the per-token KL (None when beta == 0)
    clip_ratio_low: torch.Tensor  # fraction clipped below (r < 1 − ε_low with A < 0)
    clip_ratio_high: torch.Tensor  # fraction clipped above (r > 1 + ε_high with A > 0)
    clip_ratio_region: torch.Tensor  # either


class GRPOOutput(NamedTuple):
    loss: torch.Tensor  # 0-d, fp32 (fp64 for fp64 inputs)
    metrics: GRPOMetrics


def _log_weights(logp, mask, old, level):
    log_ratio = torch.where(mask, logp - old, 0.0)
    if level == "token":
        return log_ratio
    return (log_ratio.sum(-1) / mask.sum(-1).clamp(min=1)).unsqueeze(-1)


def per_token_loss(logp, mask, adv, old, ref, *, beta, eps_low, eps_high, level):
    """TRL's per-token loss ``[r, T]`` (masked tokens: 0) and its ratio ``coef_1``."""
    old = logp.detach() if old is None else old
    coef_1 = torch.exp(_log_weights(logp, mask, old, level))
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    a = adv[:, None]
    loss = -torch.min(coef_1 * a, coef_2 * a)
    if beta != 0.0:
        d = ref - logp
        loss = loss + beta * (torch.exp(d) - d - 1)
    return torch.where(mask, loss, 0.0), coef_1


def contrib(logp, mask, adv, old, ref, *, beta, eps_low, eps_high, level, loss_type, n_seqs, denom):
    """Per-sequence terms of the loss (their sum is the loss)."""
    ptl, _ = per_token_loss(logp, mask, adv, old, ref, beta=beta, eps_low=eps_low, eps_high=eps_high, level=level)
    rows = ptl.sum(-1)
    if loss_type == "grpo":
        return rows / mask.sum(-1).clamp(min=1) / n_seqs
    return rows / denom


def _validate(hidden, weight, ids, mask, adv, bias, ref, old, beta, eps_low, eps_high, loss_type, level, temperature, max_len):
    pref.validate_head(OP_ID, hidden, weight, bias, ids, names=("hidden", "weight", "bias", "selected_token_ids"))
    b, t = hidden.shape[:2]
    check.tensor(OP_ID, "attention_mask", mask)
    if tuple(mask.shape) != (b, t):
        raise pref.OpArgumentError(OP_ID, "attention_mask", f"expected hidden's [B, T] = {(b, t)}, got {tuple(mask.shape)}")
    check.same_device(OP_ID, "attention_mask", mask, "hidden", hidden)
    check.tensor(OP_ID, "advantages", adv)
    if adv.dim() == 2 and tuple(adv.shape) == (b, t) and t != 1:
        raise pref.OpArgumentError(
            OP_ID, "advantages", f"expected one advantage per sequence, shape ({b},), got one per token {tuple(adv.shape)}"
        )
    pref.validate_vector(OP_ID, "advantages", adv, b, hidden)
    for name, x in (("ref_per_token_logps", ref), ("old_per_token_logps", old)):
        if x is not None:
            check.tensor(OP_ID, name, x)
            check.floating(OP_ID, name, x)
            if tuple(x.shape) != (b, t):
                raise pref.OpArgumentError(OP_ID, name, f"expected hidden's [B, T] = {(b, t)}, got {tuple(x.shape)}")
            check.same_device(OP_ID, name, x, "hidden", hidden)
    pref.validate_beta(OP_ID, beta)
    if float(beta) != 0.0 and ref is None:
        raise pref.OpArgumentError(OP_ID, "ref_per_token_logps", f"required when beta != 0 (the KL term), got None with beta = {beta}")
    check.finite_float(OP_ID, "epsilon_low", eps_low)
    if not 0.0 <= float(eps_low) < 1.0:
        raise pref.OpArgumentError(OP_ID, "epsilon_low", f"expected a number in [0, 1), got {eps_low!r}")
    check.nonnegative_float(OP_ID, "epsilon_high", eps_high)
    check.finite_float(OP_ID, "epsilon_high", eps_high)
    check.choice(OP_ID, "loss_type", loss_type, LOSS_TYPES)
    check.choice(OP_ID, "importance_sampling_level", level, IS_LEVELS)
    check.positive_float(OP_ID, "temperature", temperature)
    check.finite_float(OP_ID, "temperature", temperature)
    if max_len is not None:
        check.int64(OP_ID, "max_completion_length", max_len)
        if max_len <= 0:
            raise pref.OpArgumentError(OP_ID, "max_completion_length", f"expected a positive int, got {max_len}")
    # only the scored ids: a masked position may hold padding (TRL's pad id, or -100)
    pref.validate_targets(OP_ID, "selected_token_ids", torch.where(mask != 0, ids, 0), weight.shape[0], None)


def _setup(ids, mask, adv, ref, old, beta, eps_low, eps_high, loss_type, level, max_len, acc):
    b, t = ids.shape
    m = mask != 0
    target = torch.where(m, ids, _IGNORE)
    denom = m.sum().clamp(min=1) if loss_type in ("bnpo", "dapo") else b * (t if max_len is None else max_len)
    opts = dict(beta=float(beta), eps_low=float(eps_low), eps_high=float(eps_high), level=level)
    fn = partial(contrib, **opts, loss_type=loss_type, n_seqs=b, denom=denom)
    aux = (m, adv.detach().to(acc), None if old is None else old.detach().to(acc), None if ref is None else ref.detach().to(acc))
    return target, fn, aux, opts


def _metrics(logps, aux, opts) -> GRPOMetrics:
    m, adv, old, ref = aux
    with torch.no_grad():
        _, coef_1 = per_token_loss(logps, m, adv, old, ref, **opts)
        n = m.sum()

        def mean(x):  # TRL's masked_batch_mean: a per-sequence ratio is averaged over sequences
            return x.float().mean() if x.shape[-1] == 1 else torch.where(m, x, 0).sum() / n

        a = adv[:, None]
        low = (coef_1 < 1 - opts["eps_low"]) & (a < 0)
        high = (coef_1 > 1 + opts["eps_high"]) & (a > 0)
        kl = None
        if opts["beta"] != 0.0:
            d = ref - logps
            kl = torch.where(m, torch.exp(d) - d - 1, 0).sum() / n
        return GRPOMetrics(kl, mean(low), mean(high), mean(low | high))


def fused_linear_grpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    selected_token_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    advantages: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ref_per_token_logps: torch.Tensor | None = None,
    old_per_token_logps: torch.Tensor | None = None,
    beta: float = 0.04,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    loss_type: str = "grpo",
    importance_sampling_level: str = "token",
    temperature: float = 1.0,
    max_completion_length: int | None = None,
    impl: str | None = None,
) -> GRPOOutput:
    """GRPO loss (TRL's) of an LM head over completions, without ``[N, V]`` logits.

    >>> import torch, polykernel
    >>> h, w = torch.randn(2, 5, 16, requires_grad=True), torch.randn(50, 16, requires_grad=True)
    >>> ids, mask = torch.randint(0, 50, (2, 5)), torch.ones(2, 5, dtype=torch.long)
    >>> out = polykernel.fused_linear_grpo_loss(h, w, ids, mask, torch.tensor([1.0, -1.0]), beta=0.0)
    >>> out.loss.backward(); h.grad.shape
    torch.Size([2, 5, 16])
    """
    _validate(hidden, weight, selected_token_ids, attention_mask, advantages, bias, ref_per_token_logps, old_per_token_logps, beta,
              epsilon_low, epsilon_high, loss_type, importance_sampling_level, temperature, max_completion_length)  # fmt: skip
    if impl == "liger":
        return pref.liger(OP_ID).grpo(hidden, weight, selected_token_ids, attention_mask, advantages, bias, ref_per_token_logps,
                         old_per_token_logps, float(beta), float(epsilon_low), float(epsilon_high), loss_type,
                         importance_sampling_level, float(temperature), max_completion_length)  # fmt: skip
    prim = pref.primitive(OP_ID, impl, hidden)
    acc = torch.promote_types(hidden.dtype, torch.float32)
    target, fn, aux, opts = _setup(selected_token_ids, attention_mask, advantages, ref_per_token_logps, old_per_token_logps, beta,
                                   epsilon_low, epsilon_high, loss_type, importance_sampling_level, max_completion_length, acc)  # fmt: skip
    loss, logps = walker.run(prim, hidden, weight, bias, target, _IGNORE, float(temperature), False, fn, aux)
    return GRPOOutput(loss, _metrics(logps, aux, opts))


def reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    selected_token_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    advantages: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ref_per_token_logps: torch.Tensor | None = None,
    old_per_token_logps: torch.Tensor | None = None,
    beta: float = 0.04,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    loss_type: str = "grpo",
    importance_sampling_level: str = "token",
    temperature: float = 1.0,
    max_completion_length: int | None = None,
) -> GRPOOutput:
    """The semantics in float64 from the full ``[B, T, V]`` logits (differentiable)."""
    target, fn, aux, opts = _setup(selected_token_ids, attention_mask, advantages, ref_per_token_logps, old_per_token_logps, beta,
                                   epsilon_low, epsilon_high, loss_type, importance_sampling_level, max_completion_length,
                                   torch.float64)  # fmt: skip
    logps = pref.reference_token_logps(hidden, weight, bias, target, _IGNORE, temperature)
    loss = fn(logps, *aux).sum()
    return GRPOOutput(loss, _metrics(logps.detach(), aux, opts))
