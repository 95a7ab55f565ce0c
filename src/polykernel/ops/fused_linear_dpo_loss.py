"""``loss.fused_linear_dpo_loss``: DPO's loss fused with the LM head (Liger's
``LigerFusedLinearDPOLoss``, TRL's ``DPOTrainer`` ``loss_type="sigmoid"``), the ``[N, V]``
logits never held for the whole batch.

``hidden [2B, T, H]``, ``target [2B, T]``: the first B rows chosen, the last B rejected. A
sequence's log-prob is the sum of its scored tokens' log-probs (target ≠ ``ignore_index``), or
their mean with ``average_log_prob``. With ``c, r`` the policy's and ``c_ref, r_ref`` the
reference's (from ``ref_chosen_logps``/``ref_rejected_logps``, else from a reference head
``ref_hidden``/``ref_weight``/``ref_bias`` without gradient, else 0)::

    loss = mean over pairs of −logσ(β·((c − r) − (c_ref − r_ref)))   (+ NLL with compute_nll_loss)

``nll_loss`` is the chosen rows' token-mean NLL (NaN when no chosen token is scored).
Gradients reach hidden, weight and bias through ``loss`` only (the statistics are detached).
Impls (the backends'): ``torch`` and ``triton`` (one chunked driver with the torch or the Triton
per-token primitive, through :func:`chunked`), ``liger`` (Liger's chunked loss).
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

OP_ID = "loss.fused_linear_dpo_loss"


_op: Op  # defined below, after the public function it serves (with _dispatch, its dispatch)


class DPOOutput(NamedTuple):
    loss: torch.Tensor  # 0-d, fp32 (fp64 for fp64 inputs)
    chosen_logps: torch.Tensor  # [B]
    rejected_logps: torch.Tensor  # [B]
    chosen_rewards: torch.Tensor  # [B], β·(c − c_ref)
    rejected_rewards: torch.Tensor  # [B], β·(r − r_ref)
    nll_loss: torch.Tensor  # 0-d, the chosen rows' token-mean NLL


def contrib(
    logp: torch.Tensor, mask: torch.Tensor, ref: torch.Tensor, *, beta: float, average: bool, n_pairs: int,
    nll_tokens: torch.Tensor | None,
) -> torch.Tensor:  # fmt: skip
    """Per-pair terms of the loss (their sum is the loss) for rows ``[chosen k; rejected k]``."""
    k = logp.shape[0] // 2
    c, r = pref.pair_logps(logp, mask, average)
    margin = (c - r) - (ref[:k] - ref[k:])
    terms = -F.logsigmoid(beta * margin) / n_pairs
    if nll_tokens is not None:
        terms = terms - logp[:k].sum(-1) / nll_tokens
    return terms


def validate_options(op: str, *, beta=0.1, ignore_index=-100, average_log_prob=False, compute_nll_loss=False) -> None:
    """The options' own checks (no tensor needed): every call, and ``nn.FusedLinearDPOLoss``'s
    constructor (``ignore_index`` against the target's dtype: per call)."""
    pref.validate_beta(op, beta)
    check.ignore_index(op, ignore_index, "target", None)
    check.boolean(op, "average_log_prob", average_log_prob)
    check.boolean(op, "compute_nll_loss", compute_nll_loss)


def _validate(hidden, weight, target, bias, ref_hidden, ref_weight, ref_bias, ref_chosen_logps, ref_rejected_logps, beta,
              ignore_index, *_: object) -> None:  # fmt: skip
    pref.validate_head(OP_ID, hidden, weight, bias, target)
    pref.validate_pairs(OP_ID, "hidden", hidden)
    b = hidden.shape[0] // 2
    if (ref_chosen_logps is None) != (ref_rejected_logps is None):
        raise pref.OpArgumentError(OP_ID, "ref_rejected_logps" if ref_rejected_logps is None else "ref_chosen_logps",
                                   "ref_chosen_logps and ref_rejected_logps come together")  # fmt: skip
    if ref_chosen_logps is not None:
        pref.validate_vector(OP_ID, "ref_chosen_logps", ref_chosen_logps, b, hidden, "one per chosen sequence")
        pref.validate_vector(OP_ID, "ref_rejected_logps", ref_rejected_logps, b, hidden, "one per rejected sequence")
        if ref_hidden is not None:
            raise pref.OpArgumentError(OP_ID, "ref_hidden", "give either reference log-probs or a reference head, not both")
    pref.validate_ref_head(OP_ID, hidden, weight, target, ref_hidden, ref_weight, ref_bias)
    validate_options(OP_ID, beta=beta)  # ignore_index: below, against the target's dtype
    check.ignore_index(OP_ID, ignore_index, "target", target)
    pref.validate_targets(OP_ID, "target", target, weight.shape[0], ignore_index)


def _stats(logps, mask, ref, beta, average, b, loss) -> DPOOutput:
    with torch.no_grad():
        c, r = pref.pair_logps(logps, mask, average)
        return DPOOutput(loss, c, r, beta * (c - ref[:b]), beta * (r - ref[b:]), pref.chosen_nll(logps, mask))


def fused_linear_dpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ref_hidden: torch.Tensor | None = None,
    ref_weight: torch.Tensor | None = None,
    ref_bias: torch.Tensor | None = None,
    ref_chosen_logps: torch.Tensor | None = None,
    ref_rejected_logps: torch.Tensor | None = None,
    beta: float = 0.1,
    ignore_index: int = -100,
    average_log_prob: bool = False,
    compute_nll_loss: bool = False,
    impl: str | None = None,
) -> DPOOutput:
    """DPO loss of an LM head over ``[chosen; rejected]`` sequences, without ``[N, V]`` logits.

    >>> import torch, polykernel
    >>> h, w = torch.randn(4, 5, 16, requires_grad=True), torch.randn(50, 16, requires_grad=True)
    >>> out = polykernel.fused_linear_dpo_loss(h, w, torch.randint(0, 50, (4, 5)), beta=0.1)
    >>> out.loss.backward(); out.chosen_logps.shape, h.grad.shape
    (torch.Size([2]), torch.Size([4, 5, 16]))
    """
    args = (hidden, weight, target, bias, ref_hidden, ref_weight, ref_bias, ref_chosen_logps, ref_rejected_logps, beta, ignore_index,
            average_log_prob, compute_nll_loss)  # fmt: skip
    _validate(*args[:11])  # every call: the token ids' range is data, never memoized
    if _any_autocast():  # the heads as F.linear there, every impl alike (ops._autocast)
        return _autocast.dispatch(_op, _dispatch, impl, args)
    return _dispatch(impl, *args)


def chunked(head: pref.Head, hidden, weight, target, bias, ref_hidden, ref_weight, ref_bias, ref_chosen_logps, ref_rejected_logps,
            beta, ignore_index, average_log_prob, compute_nll_loss) -> DPOOutput:  # fmt: skip
    """The loss through ``head``, the calling impl's chunked linear + log-prob machinery."""
    b = hidden.shape[0] // 2
    mask = target != ignore_index
    acc = torch.promote_types(hidden.dtype, torch.float32)
    if ref_chosen_logps is not None:
        ref = torch.cat([ref_chosen_logps, ref_rejected_logps]).detach().to(acc)
    elif ref_hidden is not None:
        ref_tok = head.logps_only(ref_hidden, ref_weight, ref_bias, target, ignore_index)
        ref = pref.sequence_logps(ref_tok, mask, average_log_prob).to(acc)
    else:
        ref = torch.zeros(2 * b, dtype=acc, device=hidden.device)
    fn = partial(contrib, beta=float(beta), average=average_log_prob, n_pairs=b, nll_tokens=mask[:b].sum() if compute_nll_loss else None)
    loss, logps = head.run(hidden, weight, bias, target, ignore_index, 1.0, True, fn, (mask, ref))
    return _stats(logps, mask, ref, float(beta), average_log_prob, b, loss)


def reference(hidden, weight, target, bias=None, ref_hidden=None, ref_weight=None, ref_bias=None, ref_chosen_logps=None,
              ref_rejected_logps=None, beta=0.1, ignore_index=-100, average_log_prob=False, compute_nll_loss=False) -> DPOOutput:  # fmt: skip
    """The semantics in float64 from the full ``[2B, T, V]`` logits (differentiable)."""
    b = hidden.shape[0] // 2
    mask = target != ignore_index
    logps = pref.reference_token_logps(hidden, weight, bias, target, ignore_index)
    if ref_chosen_logps is not None:
        ref = torch.cat([ref_chosen_logps, ref_rejected_logps]).detach().double()
    elif ref_hidden is not None:
        with torch.no_grad():
            ref = pref.sequence_logps(
                pref.reference_token_logps(ref_hidden, ref_weight, ref_bias, target, ignore_index), mask, average_log_prob
            )
    else:
        ref = torch.zeros(2 * b, dtype=torch.float64, device=hidden.device)
    nll = mask[:b].sum() if compute_nll_loss else None
    loss = contrib(logps, mask, ref, beta=float(beta), average=average_log_prob, n_pairs=b, nll_tokens=nll).sum()
    return pref.contract(_stats(logps.detach(), mask, ref, float(beta), average_log_prob, b, loss), hidden)


error_model = error_model_for(reference, {"hidden": 0, "weight": 1, "bias": 3})


outputs = pref.pair_outputs(1)  # the first-call check: loss, the [B] log-probs and rewards, nll_loss
example = pref.pair_example


def cases(device, dtype, large: bool = False) -> list[Case]:
    """Awkward shapes and every option, sized for the CPU interpreter unless ``large``."""
    head = partial(pref.case_head, device=device, dtype=dtype)
    h, w, t, bias = head(4, 6, 16, 97)
    rh, rw, _, rb = head(4, 6, 16, 97, grad=False)
    out = [
        Case("4x6x16x97", (h, w, t, bias)),
        Case("2x1x8x1-nobias", head(2, 1, 8, 1)[:3]),
        Case("4x6x16x97-avg-nll", (h, w, t, bias), {"beta": 0.5, "average_log_prob": True, "compute_nll_loss": True}),
        Case("4x6x16x97-ref-head", (h, w, t, bias), {"ref_hidden": rh, "ref_weight": rw, "ref_bias": rb}),
        Case("4x6x16x97-ref-logps", (h, w, t, bias),
             {"ref_chosen_logps": torch.randn(2, device=device) * 5, "ref_rejected_logps": torch.randn(2, device=device) * 5}),
        Case("6x5x24x300-strong-beta", head(6, 5, 24, 300), {"beta": 2.0}),
        Case("2x4x8x50-allignored", head(2, 4, 8, 50, ignored=1.0)),
    ]  # fmt: skip
    if large:
        out.append(example(pref.LARGE_SHAPE, dtype, device, True))
    return out


flops, bytes_moved = pref.with_ref_head(4)  # the policy head's, plus the reference head's forward when given

_op = Op(OP_ID, validate=_validate, reference=reference, autocast=_autocast.head_args(reference), outputs=outputs, error_model=error_model, cases=cases, example=example,
         **pref.op_fields(reference, bytes_moved))  # impls: the backends' manifests (polykernel.backends)  # fmt: skip
_dispatch = _op.dispatch  # bound once
_any_autocast = _autocast.any_autocast
