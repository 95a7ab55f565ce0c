"""The inputs of ``post_training_losses.py``'s losses, and polykernel's call of each (one
``impl``). The shapes (issue 35, table 2; the preference losses' are issue 22's and ``polykernel
bench``'s): the preference and RL losses over N = 8×1024 tokens of a 1B model's head (H = 2048,
V = 128256); kl_div, jsd and tvd over [8192, 128256] log-probs/probabilities (``polykernel
bench``'s); fused_linear_jsd with student and teacher heads of N = 8192, H = 2048, V = 128256
(``polykernel bench`` uses H = 4096: here one H for all the fused heads).

Then the cross-entropy options, one option a loss (``ce_<option>``: cross_entropy over [8192,
128256] logits; ``flce_<option>``: fused_linear_cross_entropy, hidden [8192, 2048], head [128256,
2048]): softcap 30 (Gemma 2's), z_loss 1e-4 (PaLM's), class weights (seeded, in [0.5, 1.5), fp32),
label_smoothing 0.1; ~10% of the targets ignored. One option at a time: with class weights and
z_loss together, Liger's z-loss is not polykernel's (``_liger_losses.py``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import _plain_losses as plain
import torch
from _plain_losses import IGNORE, token_logps

import polykernel

PREFERENCE = ("dpo", "orpo", "cpo", "simpo", "kto", "grpo")
DISTILL = ("kl_div", "jsd", "tvd", "fused_linear_jsd")
CE_OPTIONS = ("softcap", "z_loss", "weight", "label_smoothing")  # cross_entropy's keyword names
CE_OPTION_LOSSES = tuple(f"{form}_{option}" for form in ("ce", "flce") for option in CE_OPTIONS)
LOSSES = PREFERENCE + DISTILL + CE_OPTION_LOSSES  # the ten first: the table's main rows (a cut run keeps them)
OPTION_VALUES = {"softcap": 30.0, "z_loss": 1e-4, "label_smoothing": 0.1}  # class weights: drawn (ce_option_inputs)
# std-4 logits: the largest (~20) are where a softcap of 30 bends them, so the option moves the loss
LOGIT_STD = 4.0


@dataclass(frozen=True)
class Shapes:
    seqs: int  # sequences (pairs × 2 for the paired losses)
    t: int  # tokens per sequence
    h: int
    v: int

    @property
    def n(self) -> int:  # tokens in all
        return self.seqs * self.t


FULL = Shapes(seqs=8, t=1024, h=2048, v=128256)
TINY = Shapes(seqs=4, t=16, h=32, v=1000)


def inputs(loss: str, s: Shapes, device: torch.device, dtype: torch.dtype) -> SimpleNamespace:
    """``loss``'s tensors (seeded), ``grads`` (those whose gradients a step takes) and ``shape``."""
    torch.manual_seed(0)
    g = dict(device=device)
    if loss in CE_OPTION_LOSSES:
        return ce_option_inputs(loss, s, device, dtype)
    if loss in PREFERENCE:  # [chosen; rejected] (or KTO's / GRPO's sequences) x T tokens
        x = SimpleNamespace(
            hidden=torch.randn(s.seqs, s.t, s.h, **g).to(dtype).requires_grad_(),
            weight=(torch.randn(s.v, s.h, **g) / s.h**0.5).to(dtype).requires_grad_(),
            target=torch.randint(0, s.v, (s.seqs, s.t), **g),
        )
        x.target[:, : s.t // 10] = IGNORE  # ~10% of the tokens (the prompt) not scored
        x.grads, x.shape = (x.hidden, x.weight), f"R={s.seqs},T={s.t},H={s.h},V={s.v}"
        if loss == "kto":
            x.desirable = torch.arange(s.seqs, **g) % 2 == 0
        if loss == "grpo":  # completions (no prompt), old and reference log-probs near the policy's
            x.mask = (torch.rand(s.seqs, s.t, **g) > 0.1).long()
            x.adv = torch.randn(s.seqs, **g)
            x.target = torch.randint(0, s.v, (s.seqs, s.t), **g)
            with torch.no_grad():
                lp = token_logps(x.hidden, x.weight, x.target)[0]
            x.old, x.ref = lp + 0.05 * torch.randn_like(lp), lp + 0.05 * torch.randn_like(lp)
        return x
    n, v = s.n, s.v
    labels = torch.randint(0, v, (n,), **g).masked_fill(torch.rand(n, **g) < 0.05, IGNORE)  # ~5% of the rows ignored
    shape = f"N={n},V={v}"
    if loss == "kl_div":  # student log-probs (gradient), teacher probabilities
        logp = torch.randn(n, v, **g).log_softmax(-1).to(dtype).requires_grad_()
        return SimpleNamespace(logp=logp, p=torch.randn(n, v, **g).softmax(-1).to(dtype), grads=(logp,), shape=shape)
    if loss == "jsd":  # student (gradient) and teacher log-probs
        s_lp = (2 * torch.randn(n, v, **g)).log_softmax(-1).to(dtype).requires_grad_()
        t_lp = (2 * torch.randn(n, v, **g)).log_softmax(-1).to(dtype)
        return SimpleNamespace(student=s_lp, teacher=t_lp, labels=labels, grads=(s_lp,), shape=shape)
    if loss == "tvd":  # two distributions, p's gradient
        p = torch.randn(n, v, **g).softmax(-1).to(dtype).requires_grad_()
        return SimpleNamespace(p=p, q=torch.randn(n, v, **g).softmax(-1).to(dtype), labels=labels, grads=(p,), shape=shape)
    assert loss == "fused_linear_jsd", loss  # student head (gradients of hidden and weight), teacher head without
    h = s.h
    x = SimpleNamespace(
        hs=torch.randn(n, h, **g).to(dtype).requires_grad_(),
        ws=(torch.randn(v, h, **g) / h**0.5).to(dtype).requires_grad_(),
        ht=torch.randn(n, h, **g).to(dtype),
        wt=(torch.randn(v, h, **g) / h**0.5).to(dtype),
        labels=labels,
        shape=f"N={n},H={h},V={v}",
    )
    x.grads = (x.hs, x.ws)
    return x


def split_option(loss: str) -> tuple[str, str]:
    """``"flce_z_loss"`` -> ``("flce", "z_loss")``."""
    form, option = loss.split("_", 1)
    return form, option


def ce_option_inputs(loss: str, s: Shapes, device: torch.device, dtype: torch.dtype) -> SimpleNamespace:
    """A ``ce_*`` loss's logits (or an ``flce_*`` loss's hidden and head), targets and ``options``
    (the one option, in cross_entropy's keyword names). Drawn in one order for every option, so
    the four ``ce_*`` (or ``flce_*``) losses score the same logits."""
    form, option = split_option(loss)
    g = dict(device=device)
    n, v, h = s.n, s.v, s.h
    target = torch.randint(0, v, (n,), **g).masked_fill(torch.rand(n, **g) < 0.1, IGNORE)  # ~10% not scored
    if form == "ce":
        logits = (LOGIT_STD * torch.randn(n, v, **g)).to(dtype).requires_grad_()
        x = SimpleNamespace(logits=logits, target=target, grads=(logits,), shape=f"N={n},V={v}")
    else:
        hidden = torch.randn(n, h, **g).to(dtype).requires_grad_()
        weight = (LOGIT_STD * torch.randn(v, h, **g) / h**0.5).to(dtype).requires_grad_()
        x = SimpleNamespace(hidden=hidden, weight=weight, target=target, grads=(hidden, weight), shape=f"N={n},H={h},V={v}")
    if option == "weight":  # drawn last, so the logits stay the other options'; fp32 whatever the logits
        x.options = {"weight": 0.5 + torch.rand(v, **g)}
    else:
        x.options = {option: OPTION_VALUES[option]}
    return x


def polykernel_call(loss: str, x: SimpleNamespace, impl: str | None) -> Callable[[], object]:
    """polykernel's public function at its defaults (``impl`` None: its own choice)."""
    pk = polykernel
    if loss in CE_OPTION_LOSSES:
        if split_option(loss)[0] == "ce":
            return lambda: pk.cross_entropy(x.logits, x.target, **x.options, impl=impl)
        flce_options = {"ce_weight" if k == "weight" else k: val for k, val in x.options.items()}  # weight is the head here
        return lambda: pk.fused_linear_cross_entropy(x.hidden, x.weight, x.target, **flce_options, impl=impl)
    calls = {
        "dpo": lambda: pk.fused_linear_dpo_loss(x.hidden, x.weight, x.target, impl=impl),
        "orpo": lambda: pk.fused_linear_orpo_loss(x.hidden, x.weight, x.target, impl=impl),
        "cpo": lambda: pk.fused_linear_cpo_loss(x.hidden, x.weight, x.target, impl=impl),
        "simpo": lambda: pk.fused_linear_simpo_loss(x.hidden, x.weight, x.target, impl=impl),
        "kto": lambda: pk.fused_linear_kto_loss(x.hidden, x.weight, x.target, x.desirable, impl=impl),
        "grpo": lambda: pk.fused_linear_grpo_loss(
            x.hidden, x.weight, x.target, x.mask, x.adv, ref_per_token_logps=x.ref, old_per_token_logps=x.old, impl=impl
        ),
        "kl_div": lambda: pk.kl_div(x.logp, x.p, impl=impl),
        "jsd": lambda: pk.jsd(x.student, x.teacher, x.labels, impl=impl),
        "tvd": lambda: pk.tvd(x.p, x.q, x.labels, impl=impl),
        "fused_linear_jsd": lambda: pk.fused_linear_jsd(x.hs, x.ws, x.ht, x.wt, x.labels, impl=impl),
    }
    return calls[loss]


def plain_call(loss: str, x: SimpleNamespace) -> Callable[[], object]:
    """The plain loss (``_plain_losses``) on the same inputs."""
    if loss in CE_OPTION_LOSSES:
        if split_option(loss)[0] == "ce":
            return lambda: plain.cross_entropy(x.logits, x.target, **x.options)
        return lambda: plain.fused_linear_cross_entropy(x.hidden, x.weight, x.target, **x.options)
    calls = {
        "dpo": lambda: plain.dpo(x.hidden, x.weight, x.target),
        "orpo": lambda: plain.orpo(x.hidden, x.weight, x.target),
        "cpo": lambda: plain.cpo(x.hidden, x.weight, x.target),
        "simpo": lambda: plain.simpo(x.hidden, x.weight, x.target),
        "kto": lambda: plain.kto(x.hidden, x.weight, x.target, x.desirable),
        "grpo": lambda: plain.grpo(x.hidden, x.weight, x.target, x.mask, x.adv, x.ref, x.old),
        "kl_div": lambda: plain.kl_div(x.logp, x.p),
        "jsd": lambda: plain.jsd(x.student, x.teacher, x.labels),
        "tvd": lambda: plain.tvd(x.p, x.q, x.labels),
        "fused_linear_jsd": lambda: plain.fused_linear_jsd(x.hs, x.ws, x.ht, x.wt, x.labels),
    }
    return calls[loss]
