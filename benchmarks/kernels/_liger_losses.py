"""Liger-Kernel's losses called as its users call them (liger_kernel 0.8.5): its own modules, not
polykernel's registry — ``liger_kernel.chunked_loss`` for the preference and RL losses,
``liger_kernel.transformers`` for distillation and cross-entropy — built with their defaults. Where
a default means another loss than the one ``post_training_losses.py`` asks polykernel for, the
argument is set to polykernel's so that the values compare; each such argument says why.
Everything else (chunk size, ``compiled=True``, the fused losses' ``accum_dtype=None``, its dtypes)
is Liger's default.

The cross-entropy options map one to one (``z_loss`` is Liger's ``lse_square_scale``; class
weights its ``weight``, ``ce_weight`` in the fused loss) and mean the same one at a time; together,
class weights and z-loss differ: Liger's z-loss is unweighted and divided by the count, not the
summed class weights (polykernel's docstring). Two differences of form stay, as Liger's users get
them: its cross_entropy rounds the per-row losses to the logits' dtype, and writes its gradient
over the logits (no [N, V] gradient allocated; see :func:`overwrites_input`)."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace


def overwrites_input(loss: str) -> bool:
    """Whether Liger's module for ``loss`` writes over its inputs: its cross_entropy stores the
    gradient in the logits (its memory trick), so its row needs logits of its own."""
    return loss.startswith("ce_")


def ce_options(options: dict[str, object], weight_name: str) -> dict[str, object]:
    """polykernel's cross-entropy options (``_loss_cases.ce_option_inputs``) in Liger's names."""
    names = {"z_loss": "lse_square_scale", "weight": weight_name, "softcap": "softcap", "label_smoothing": "label_smoothing"}
    return {names[k]: v for k, v in options.items()}


def liger_call(loss: str, x: SimpleNamespace, compiled: bool = True) -> Callable[[], object]:
    """Liger's module for ``loss`` on the inputs of ``_loss_cases.inputs`` (the import may raise:
    the row records it). ``compiled=False`` only for a CPU check of the mapping (``--liger-on-cpu``):
    Liger's default compiles each chunk's function with torch.compile."""
    from liger_kernel import chunked_loss as cl
    from liger_kernel import transformers as lt

    c = {} if compiled else {"compiled": False}
    if loss.startswith("ce_"):  # defaults = polykernel's (ignore_index -100, "mean")
        ce = lt.LigerCrossEntropyLoss(**ce_options(x.options, "weight"))
        return lambda: ce(x.logits, x.target)
    if loss.startswith("flce_"):  # defaults = polykernel's; the head first, as Liger's forward takes it
        flce = lt.LigerFusedLinearCrossEntropyLoss(**ce_options(x.options, "ce_weight"))
        return lambda: flce(x.weight, x.hidden, x.target)
    if loss == "dpo":
        # use_ref_model: Liger's default (True) reads a reference head; polykernel's call has none
        # (reference log-probs 0, its default). compute_nll_loss=False is both defaults.
        m = cl.LigerFusedLinearDPOLoss(use_ref_model=False, **c)
        return lambda: m(x.weight, x.hidden, x.target)
    if loss == "orpo":  # defaults = polykernel's (beta 0.1, the NLL added)
        m = cl.LigerFusedLinearORPOLoss(**c)
        return lambda: m(x.weight, x.hidden, x.target)
    if loss == "cpo":  # defaults = polykernel's (beta 0.1, alpha 1, the NLL added, summed log-probs)
        m = cl.LigerFusedLinearCPOLoss(**c)
        return lambda: m(x.weight, x.hidden, x.target)
    if loss == "simpo":
        # beta: Liger's default is 0.1, polykernel's (and the SimPO paper's / TRL's) 2.0;
        # compute_nll_loss: Liger's default adds the chosen NLL, polykernel's SimPO has none
        m = cl.LigerFusedLinearSimPOLoss(beta=2.0, compute_nll_loss=False, **c)
        return lambda: m(x.weight, x.hidden, x.target)
    if loss == "kto":  # defaults = polykernel's (beta 0.1, no reference, KL 0)
        m = cl.LigerFusedLinearKTOLoss(**c)
        return lambda: m(x.hidden, x.weight, x.target, preference_labels=x.desirable)
    if loss == "grpo":
        # loss_type: Liger's default is "dapo" (token mean over the batch), polykernel's (and
        # TRL's GRPO paper form) "grpo" (per-sequence means, then their mean)
        m = cl.LigerFusedLinearGRPOLoss(loss_type="grpo", **c)
        return lambda: m(x.hidden, x.weight, x.target, x.mask, x.adv, ref_per_token_logps=x.ref, old_per_token_logps=x.old)
    if loss == "kl_div":
        # reduction: LigerKLDIVLoss is an nn.KLDivLoss, whose default is "mean" (over every
        # element); polykernel's kl_div (and the distillation trainers') "batchmean"
        m = lt.LigerKLDIVLoss(reduction="batchmean")
        return lambda: m(x.logp, x.p)
    if loss == "jsd":  # defaults = polykernel's (beta 0.5); (student, teacher) log-probs, labels
        m = lt.LigerJSD()
        return lambda: m(x.student, x.teacher, x.labels)
    if loss == "tvd":  # defaults = polykernel's ("batchmean")
        m = lt.LigerTVDLoss()
        return lambda: m(x.p, x.q, x.labels)
    assert loss == "fused_linear_jsd", loss  # defaults = polykernel's (beta 0.5, temperature 1)
    m = lt.LigerFusedLinearJSD()
    return lambda: m(x.hs, x.ws, x.ht, x.wt, x.labels)
