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
``loss`` only. Impls (the backends'): ``torch``, ``triton`` (one chunked driver, through
:func:`chunked`: with token-level importance sampling every token is
its own unit, so chunks are token rows and one pass serves any completion length; with
sequence-level a chunk holds whole sequences, so the sequence's ratio never couples chunks, or,
when one sequence exceeds the chunk budget, all log-probs are computed first), ``liger``.
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

OP_ID = "loss.fused_linear_grpo_loss"
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
IS_LEVELS = ("token", "sequence")
_IGNORE = -100  # the driver's marker of a masked token (token ids are >= 0)


_op: Op  # defined below, after the public function it serves (with _dispatch, its dispatch)


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


def per_token_loss(logp, mask, adv, old, ref, *, beta, eps_low, eps_high, level, bias_correction=False):
    """TRL's per-token loss ``[r, T]`` (masked tokens: 0) and its ratio ``coef_1``; with
    ``bias_correction`` (TRL's ``use_bias_correction_kl``) the KL term is weighted by the ratio,
    gradient included."""
    old = logp.detach() if old is None else old
    coef_1 = torch.exp(_log_weights(logp, mask, old, level))
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    a = adv[:, None]
    loss = -torch.min(coef_1 * a, coef_2 * a)
    if beta != 0.0:
        loss = loss + beta * _kl(logp, ref, coef_1, bias_correction)
    return torch.where(mask, loss, 0.0), coef_1


def _kl(logp, ref, coef_1, bias_correction):
    d = ref - logp
    kl = torch.exp(d) - d - 1
    return kl * coef_1 if bias_correction else kl


def contrib(logp, mask, adv, old, ref, denom, *, beta, eps_low, eps_high, level, bias_correction=False):
    """Per-row terms of the loss (their sum is the loss); ``denom [r]``: each row's normaliser."""
    ptl, _ = per_token_loss(logp, mask, adv, old, ref, beta=beta, eps_low=eps_low, eps_high=eps_high, level=level,
                            bias_correction=bias_correction)  # fmt: skip
    return ptl.sum(-1) / denom


def validate_options(op: str, *, beta=0.04, epsilon_low=0.2, epsilon_high=0.2, loss_type="grpo", importance_sampling_level="token",
                     temperature=1.0, max_completion_length=None, use_bias_correction_kl=False) -> None:  # fmt: skip
    """The options' own checks (no tensor needed): every call, and ``nn.FusedLinearGRPOLoss``'s
    constructor (whether ``beta != 0`` has its ``ref_per_token_logps``: per call)."""
    pref.validate_beta(op, beta)
    check.finite_float(op, "epsilon_low", epsilon_low)
    if not 0.0 <= float(epsilon_low) < 1.0:
        raise pref.OpArgumentError(op, "epsilon_low", f"expected a number in [0, 1), got {check.shown(epsilon_low)}")
    check.nonnegative_float(op, "epsilon_high", epsilon_high)
    check.finite_float(op, "epsilon_high", epsilon_high)
    check.choice(op, "loss_type", loss_type, LOSS_TYPES)
    check.choice(op, "importance_sampling_level", importance_sampling_level, IS_LEVELS)
    check.positive_float(op, "temperature", temperature)
    check.finite_float(op, "temperature", temperature)
    if max_completion_length is not None:
        check.int64(op, "max_completion_length", max_completion_length)
        if max_completion_length <= 0:
            raise pref.OpArgumentError(op, "max_completion_length", f"expected a positive int, got {max_completion_length}")
    check.boolean(op, "use_bias_correction_kl", use_bias_correction_kl)


def _validate(hidden, weight, ids, mask, adv, bias, ref, old, beta, eps_low, eps_high, loss_type, level, temperature, max_len,
              bias_correction=False):  # fmt: skip
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
    validate_options(OP_ID, beta=beta, epsilon_low=eps_low, epsilon_high=eps_high, loss_type=loss_type,
                     importance_sampling_level=level, temperature=temperature, max_completion_length=max_len,
                     use_bias_correction_kl=bias_correction)  # fmt: skip
    # only the scored ids: a masked position may hold padding (TRL's pad id, or -100)
    pref.validate_targets(OP_ID, "selected_token_ids", torch.where(mask != 0, ids, 0), weight.shape[0], None)


def _setup(ids, mask, adv, ref, old, beta, eps_low, eps_high, loss_type, level, max_len, acc, bias_correction=False):
    b, t = ids.shape
    m = mask != 0
    target = torch.where(m, ids, _IGNORE)
    if loss_type == "grpo":  # each sequence's masked mean, then the mean over sequences
        denom = b * m.sum(-1).clamp(min=1).to(acc)
    else:  # bnpo, dapo: the masked count; dr_grpo: B · max_completion_length
        total = m.sum().clamp(min=1) if loss_type in ("bnpo", "dapo") else b * (t if max_len is None else max_len)
        denom = torch.full((b,), 1.0, dtype=acc, device=ids.device) * total
    opts = dict(beta=float(beta), eps_low=float(eps_low), eps_high=float(eps_high), level=level, bias_correction=bool(bias_correction))
    aux = (m, adv.detach().to(acc), None if old is None else old.detach().to(acc), None if ref is None else ref.detach().to(acc), denom)
    return target, partial(contrib, **opts), aux, opts


def _per_token(hidden, target, aux):
    """Token-level importance sampling couples no two tokens: each token is its own unit, so the
    driver's chunks need not hold whole sequences (one pass even for very long completions)."""
    b, t, h = hidden.shape
    m, adv, old, ref, denom = aux

    def col(x):
        return None if x is None else x.reshape(b * t, 1)

    per_row = (col(m), adv[:, None].expand(b, t).reshape(b * t), col(old), col(ref), denom[:, None].expand(b, t).reshape(b * t))
    return hidden.reshape(b * t, 1, h), target.reshape(b * t, 1), per_row


def _metrics(logps, aux, opts) -> GRPOMetrics:
    m, adv, old, ref, _ = aux
    with torch.no_grad():
        _, coef_1 = per_token_loss(logps, m, adv, old, ref, **opts)
        n = m.sum()

        def mean(x):  # TRL's masked_batch_mean: a per-sequence ratio is averaged over sequences
            return x.float().mean() if x.shape[-1] == 1 else torch.where(m, x, 0).sum() / n

        a = adv[:, None]
        low = (coef_1 < 1 - opts["eps_low"]) & (a < 0)
        high = (coef_1 > 1 + opts["eps_high"]) & (a > 0)
        kl = None
        if opts["beta"] != 0.0:  # TRL logs the KL as weighted (use_bias_correction_kl)
            kl = torch.where(m, _kl(logps, ref, coef_1, opts["bias_correction"]), 0).sum() / n
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
    use_bias_correction_kl: bool = False,
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
    args = (hidden, weight, selected_token_ids, attention_mask, advantages, bias, ref_per_token_logps, old_per_token_logps, beta,
            epsilon_low, epsilon_high, loss_type, importance_sampling_level, temperature, max_completion_length,
            use_bias_correction_kl)  # fmt: skip
    _validate(*args)  # every call: the token ids' range is data
    if _any_autocast():  # the heads as F.linear there, every impl alike (ops._autocast)
        return _autocast.dispatch(_op, _dispatch, impl, args)
    return _dispatch(impl, *args)


def chunked(head: pref.Head, hidden, weight, selected_token_ids, attention_mask, advantages, bias, ref_per_token_logps, old_per_token_logps,
            beta, epsilon_low, epsilon_high, loss_type, importance_sampling_level, temperature, max_completion_length,
            use_bias_correction_kl) -> GRPOOutput:  # fmt: skip
    """The loss through ``head``, the calling impl's chunked linear + log-prob machinery."""
    acc = torch.promote_types(hidden.dtype, torch.float32)
    target, fn, aux, opts = _setup(selected_token_ids, attention_mask, advantages, ref_per_token_logps, old_per_token_logps, beta,
                                   epsilon_low, epsilon_high, loss_type, importance_sampling_level, max_completion_length, acc,
                                   use_bias_correction_kl)  # fmt: skip
    if importance_sampling_level == "token":
        h1, t1, aux1 = _per_token(hidden, target, aux)
        loss, logps = head.run(h1, weight, bias, t1, _IGNORE, float(temperature), False, fn, aux1)
        logps = logps.view(target.shape)
    else:
        loss, logps = head.run(hidden, weight, bias, target, _IGNORE, float(temperature), False, fn, aux)
    return GRPOOutput(loss, _metrics(logps, aux, opts))


def reference(hidden, weight, selected_token_ids, attention_mask, advantages, bias=None, ref_per_token_logps=None,
              old_per_token_logps=None, beta=0.04, epsilon_low=0.2, epsilon_high=0.2, loss_type="grpo", importance_sampling_level="token",
              temperature=1.0, max_completion_length=None, use_bias_correction_kl=False) -> GRPOOutput:  # fmt: skip
    """The semantics in float64 from the full ``[B, T, V]`` logits (differentiable)."""
    target, fn, aux, opts = _setup(selected_token_ids, attention_mask, advantages, ref_per_token_logps, old_per_token_logps, beta,
                                   epsilon_low, epsilon_high, loss_type, importance_sampling_level, max_completion_length,
                                   torch.float64, use_bias_correction_kl)  # fmt: skip
    logps = pref.reference_token_logps(hidden, weight, bias, target, _IGNORE, temperature)
    loss = fn(logps, *aux).sum()
    return pref.contract(GRPOOutput(loss, _metrics(logps.detach(), aux, opts)), hidden)


error_model = error_model_for(reference, {"hidden": 0, "weight": 1, "bias": 5}, curv=lambda a: 0.0)  # no margin: ratios, KL


def outputs(hidden, *_: object) -> tuple:
    """The loss's shape and dtype (the metrics: a NamedTuple)."""
    return ((torch.Size(), pref.acc_dtype(hidden)), None)


def _completions(h, w, ids, bias, device, masked: float = 0.3, old: float = 0.3, ref: bool = True, temperature: float = 1.0):
    """Completions with a random mask (the first token always scored), advantages, and old/ref
    log-probs near the policy's (ratios of a few tenths off 1: some clipped)."""
    b, t = ids.shape
    mask = (torch.rand(b, t, device=device) > masked).long()
    mask[:, 0] = 1
    with torch.no_grad():
        lp = pref.reference_token_logps(h.detach(), w.detach(), None if bias is None else bias.detach(), ids, -100, temperature).float()
    kw = {"old_per_token_logps": lp + old * torch.randn(b, t, device=device)}
    if ref:
        kw["ref_per_token_logps"] = lp + 0.3 * torch.randn(b, t, device=device)
    return (h, w, ids, mask, torch.randn(b, device=device), bias), kw


def example(shape, dtype, device, requires_grad: bool = False) -> Case:
    """``shape`` = (B, T, H, V): B completions of T tokens, ~70% scored, β = 0.04."""
    h, w, ids = pref.example_head(shape, dtype, device, requires_grad)
    b, t = ids.shape
    mask = (torch.rand(b, t, device=device) > 0.3).long()
    kw = {"old_per_token_logps": -torch.rand(b, t, device=device) * 10, "ref_per_token_logps": -torch.rand(b, t, device=device) * 10}
    return Case("x".join(map(str, shape)), (h, w, ids.clamp(min=0), mask, torch.randn(b, device=device)), kw)


def cases(device, dtype, large: bool = False) -> list[Case]:
    """Every loss type and importance-sampling level, sized for the CPU interpreter unless ``large``."""
    head = partial(pref.case_head, device=device, dtype=dtype, ignored=0.0)
    out = []
    for i, (loss_type, level, opts) in enumerate([
        ("grpo", "token", {}),
        ("bnpo", "token", {"temperature": 0.8}),
        ("dr_grpo", "sequence", {"max_completion_length": 8, "beta": 0.0}),
        ("dapo", "sequence", {"epsilon_high": 0.28}),
        ("grpo", "sequence", {"beta": 0.0}),
        ("grpo", "token", {"use_bias_correction_kl": True, "beta": 0.1}),
        ("dapo", "sequence", {"use_bias_correction_kl": True}),
    ]):  # fmt: skip
        h, w, ids, bias = head(3, 6, 16, 97)
        args, kw = _completions(h, w, ids, bias if i % 2 == 0 else None, device, ref=opts.get("beta", 0.04) != 0.0,
                                temperature=opts.get("temperature", 1.0))  # fmt: skip
        kw.update(opts, loss_type=loss_type, importance_sampling_level=level)
        out.append(Case(f"3x6x16x97-{loss_type}-{level}" + ("-kl-weighted" if opts.get("use_bias_correction_kl") else ""), args, kw))
    h, w, ids, _ = head(2, 4, 8, 50)
    args, kw = _completions(h, w, ids, None, device, ref=False)
    args[3].zero_()  # all masked: the loss is 0
    out.append(Case("2x4x8x50-allmasked", args, dict(kw, beta=0.0)))
    h, w, ids, bias = head(4, 5, 24, 300)
    args, kw = _completions(h, w, ids, bias, device)
    out.append(Case("4x5x24x300-no-old", args, {"ref_per_token_logps": kw["ref_per_token_logps"]}))  # ratio 1: old = the policy's own
    if large:
        out.append(example(pref.LARGE_SHAPE, dtype, device, True))
    return out


flops = pref.flops
bytes_moved = pref.bytes_moved


# compile_mode "eager" (op_fields), also because the metrics' kl is None when beta = 0
_op = Op(OP_ID, validate=_validate, reference=reference, autocast=_autocast.head_args(reference), outputs=outputs, error_model=error_model, cases=cases, example=example,
         **pref.op_fields(reference))  # impls: the backends' manifests (polykernel.backends)  # fmt: skip
_dispatch = _op.dispatch  # bound once
_any_autocast = _autocast.any_autocast
