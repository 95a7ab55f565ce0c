"""``loss.fused_linear_kto_loss``: KTO's loss fused with the LM head (Liger's
``LigerFusedLinearKTOLoss``, TRL's ``KTOTrainer``), the ``[N, V]`` logits never held for the
whole batch.

``hidden [B, T, H]``, ``target [B, T]``, ``preference_labels [B]`` (True: desirable). With
``logp`` a sequence's log-prob (sum over scored tokens, or mean with ``average_log_prob``),
``logp_ref`` the reference's (``ref_logps [B]``, else a reference head ``ref_hidden``/
``ref_weight``/``ref_bias`` without gradient, else 0), ``logr = logp − logp_ref`` and ``kl`` a
given constant (TRL's batch KL estimate, default 0)::

    desirable:   1 − σ(β·(logr − kl))        undesirable:   1 − σ(β·(kl − logr))
    loss = mean over the batch

``chosen_logps``/``rejected_logps`` are the desirable/undesirable rows' log-probs (as TRL's
``KTOTrainer`` splits them), ``chosen_rewards``/``rejected_rewards`` their ``β·logr``. Impls and
chunking as ``polykernel.fused_linear_dpo_loss``'s (a chunk holds whole sequences); no
Liger adapter (Liger's KTO reports batch sums, not these per-sequence statistics).
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

OP_ID = "loss.fused_linear_kto_loss"


_op: Op  # defined below, after the public function it serves (with _dispatch, its dispatch)


class KTOOutput(NamedTuple):
    loss: torch.Tensor
    chosen_logps: torch.Tensor  # [n desirable]
    rejected_logps: torch.Tensor  # [n undesirable]
    chosen_rewards: torch.Tensor  # β·logr of the desirable rows
    rejected_rewards: torch.Tensor


def contrib(logp, mask, labels, ref, *, beta: float, kl, average: bool, n: int) -> torch.Tensor:
    logr = pref.sequence_logps(logp, mask, average) - ref
    sign = torch.where(labels, 1.0, -1.0).to(logr.dtype)
    return (1 - torch.sigmoid(beta * (logr - kl) * sign)) / n


def validate_options(op: str, *, beta=0.1, ignore_index=-100, average_log_prob=False) -> None:
    """The options' own checks (no tensor needed): every call, and ``nn.FusedLinearKTOLoss``'s
    constructor (``ignore_index`` against the target's dtype: per call)."""
    pref.validate_beta(op, beta)
    check.ignore_index(op, ignore_index, "target", None)
    check.boolean(op, "average_log_prob", average_log_prob)


def _validate(hidden, weight, target, labels, bias, ref_hidden, ref_weight, ref_bias, ref_logps, kl, beta, ignore_index, *_):
    pref.validate_head(OP_ID, hidden, weight, bias, target)
    b = hidden.shape[0]
    if b == 0:
        raise pref.OpArgumentError(OP_ID, "hidden", "expected at least one sequence, got an empty batch")
    check.tensor(OP_ID, "preference_labels", labels)
    if tuple(labels.shape) != (b,):
        raise pref.OpArgumentError(OP_ID, "preference_labels", f"expected shape ({b},) (one per sequence), got {tuple(labels.shape)}")
    if labels.dtype.is_floating_point or labels.dtype.is_complex:
        raise pref.OpTypeError(OP_ID, "preference_labels", f"expected a bool (or 0/1 integer) tensor, got {labels.dtype}")
    check.same_device(OP_ID, "preference_labels", labels, "hidden", hidden)
    # an integer label is a truth value only as 0 or 1: 2 would count as desirable silently (a host
    # sync, as the targets' range; under torch.compile the eager call behind the graph break checks)
    if labels.dtype != torch.bool and labels.numel() and not torch.compiler.is_compiling():
        bad = (labels != 0) & (labels != 1)
        if bool(bad.any()):
            raise pref.OpArgumentError(OP_ID, "preference_labels", f"expected 0/1 (or bool) labels, got {labels[bad][0].item()}")
    if ref_logps is not None:
        pref.validate_vector(OP_ID, "ref_logps", ref_logps, b, hidden)
        if ref_hidden is not None:
            raise pref.OpArgumentError(OP_ID, "ref_hidden", "give either ref_logps or a reference head, not both")
    pref.validate_ref_head(OP_ID, hidden, weight, target, ref_hidden, ref_weight, ref_bias)
    if isinstance(kl, torch.Tensor):
        if kl.numel() != 1 or not kl.dtype.is_floating_point:
            raise pref.OpArgumentError(
                OP_ID, "kl", f"expected a number or a 1-element floating tensor, got shape {tuple(kl.shape)} {kl.dtype}"
            )
    elif kl is not None:
        check.finite_float(OP_ID, "kl", kl)
    validate_options(OP_ID, beta=beta)  # ignore_index: below, against the target's dtype
    check.ignore_index(OP_ID, ignore_index, "target", target)
    pref.validate_targets(OP_ID, "target", target, weight.shape[0], ignore_index)


def _setup(target, labels, ref, kl, beta, ignore_index, average, acc):
    mask = target != ignore_index
    kl = 0.0 if kl is None else (kl.detach().reshape(()).to(acc) if isinstance(kl, torch.Tensor) else float(kl))
    return mask, labels.bool(), partial(contrib, beta=float(beta), kl=kl, average=average, n=target.shape[0]), ref.detach().to(acc)


def _stats(loss, logps, mask, labels, ref, beta, average) -> KTOOutput:
    with torch.no_grad():
        seq = pref.sequence_logps(logps, mask, average)
        rewards = beta * (seq - ref)
        return KTOOutput(loss, seq[labels], seq[~labels], rewards[labels], rewards[~labels])


def _ref(hidden, target, ref_hidden, ref_weight, ref_bias, ref_logps, ignore_index, average, head):
    if ref_logps is not None:
        return ref_logps
    if ref_hidden is not None:
        return pref.ref_sequence_logps(head, ref_hidden, ref_weight, ref_bias, target, ignore_index, average)
    return torch.zeros(hidden.shape[0], device=hidden.device)


def fused_linear_kto_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    preference_labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ref_hidden: torch.Tensor | None = None,
    ref_weight: torch.Tensor | None = None,
    ref_bias: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    kl: torch.Tensor | float | None = None,
    beta: float = 0.1,
    ignore_index: int = -100,
    average_log_prob: bool = False,
    impl: str | None = None,
) -> KTOOutput:
    """KTO loss of an LM head over desirable/undesirable sequences, without ``[N, V]`` logits.

    >>> import torch, polykernel
    >>> h, w = torch.randn(3, 5, 16, requires_grad=True), torch.randn(50, 16)
    >>> labels = torch.tensor([True, False, True])
    >>> out = polykernel.fused_linear_kto_loss(h, w, torch.randint(0, 50, (3, 5)), labels, kl=0.1)
    >>> out.loss.backward(); out.chosen_logps.shape, h.grad.shape
    (torch.Size([2]), torch.Size([3, 5, 16]))
    """
    args = (hidden, weight, target, preference_labels, bias, ref_hidden, ref_weight, ref_bias, ref_logps, kl, beta, ignore_index,
            average_log_prob)  # fmt: skip
    _validate(*args)  # every call: the token ids' range is data
    if _any_autocast():  # the heads as F.linear there, every impl alike (ops._autocast)
        return _autocast.dispatch(_op, _dispatch, impl, args)
    return _dispatch(impl, *args)


def chunked(head: pref.Head, hidden, weight, target, preference_labels, bias, ref_hidden, ref_weight, ref_bias, ref_logps, kl, beta,
            ignore_index, average_log_prob) -> KTOOutput:  # fmt: skip
    """The torch and Triton impls (no Liger: its KTO reports batch sums, not KTOOutput's
    per-sequence statistics) through ``head``, the calling impl's chunked linear + log-prob machinery."""
    acc = torch.promote_types(hidden.dtype, torch.float32)
    ref = _ref(hidden, target, ref_hidden, ref_weight, ref_bias, ref_logps, ignore_index, average_log_prob, head)
    mask, labels, fn, ref = _setup(target, preference_labels, ref, kl, beta, ignore_index, average_log_prob, acc)
    loss, logps = head.run(hidden, weight, bias, target, ignore_index, 1.0, False, fn, (mask, labels, ref))
    return _stats(loss, logps, mask, labels, ref, float(beta), average_log_prob)


def reference(hidden, weight, target, preference_labels, bias=None, ref_hidden=None, ref_weight=None, ref_bias=None,
              ref_logps=None, kl=None, beta=0.1, ignore_index=-100, average_log_prob=False) -> KTOOutput:  # fmt: skip
    """The semantics in float64 from the full ``[B, T, V]`` logits (differentiable)."""
    ref = _ref(hidden, target, ref_hidden, ref_weight, ref_bias, ref_logps, ignore_index, average_log_prob, None)
    mask, labels, fn, ref = _setup(target, preference_labels, ref, kl, beta, ignore_index, average_log_prob, torch.float64)
    loss, logps = pref.reference_run(hidden, weight, bias, target, ignore_index, fn, (mask, labels, ref))
    return pref.contract(_stats(loss, logps, mask, labels, ref, float(beta), average_log_prob), hidden)


error_model = error_model_for(reference, {"hidden": 0, "weight": 1, "bias": 4})


def outputs(hidden, *_: object) -> tuple:
    """The loss's shape and dtype (the statistics' shapes follow the labels' values)."""
    return ((torch.Size(), pref.acc_dtype(hidden)), None, None, None, None)


def example(shape, dtype, device, requires_grad: bool = False) -> Case:
    """``shape`` = (B, T, H, V): B sequences of T tokens, half of them desirable."""
    h, w, t = pref.example_head(shape, dtype, device, requires_grad)
    return Case("x".join(map(str, shape)), (h, w, t, torch.rand(shape[0], device=device) < 0.5), {"kl": 0.1})


def cases(device, dtype, large: bool = False) -> list[Case]:
    """Awkward shapes and every option, sized for the CPU interpreter unless ``large``."""
    head = partial(pref.case_head, device=device, dtype=dtype)
    h, w, t, bias = head(3, 6, 16, 97)
    rh, rw, _, rb = head(3, 6, 16, 97, grad=False)
    labels = torch.tensor([True, False, True], device=device)
    out = [
        Case("3x6x16x97", (h, w, t, labels, bias), {"kl": 0.2}),
        Case("1x1x8x1-nobias", (*head(1, 1, 8, 1)[:3], torch.tensor([False], device=device))),
        Case("3x6x16x97-ref-head-avg", (h, w, t, labels, bias), {"ref_hidden": rh, "ref_weight": rw, "ref_bias": rb, "average_log_prob": True}),
        Case("3x6x16x97-ref-logps", (h, w, t, labels, bias), {"ref_logps": torch.randn(3, device=device) * 5, "kl": torch.tensor(0.3, device=device), "beta": 0.5}),
    ]  # fmt: skip
    h, w, t, bias = head(5, 5, 24, 300)
    out.append(Case("5x5x24x300-all-desirable", (h, w, t, torch.ones(5, dtype=torch.bool, device=device), bias)))
    if large:
        out.append(example(pref.LARGE_SHAPE, dtype, device, True))
    return out


flops, bytes_moved = pref.with_ref_head(5)  # the policy head's, plus the reference head's forward when given


# compile_mode "eager" (op_fields), also because the statistics' shapes follow the labels' values
_op = Op(OP_ID, validate=_validate, reference=reference, autocast=_autocast.head_args(reference), outputs=outputs, error_model=error_model, cases=cases, example=example,
         **pref.op_fields(reference, bytes_moved))  # impls: the backends' manifests (polykernel.backends)  # fmt: skip
_dispatch = _op.dispatch  # bound once
_any_autocast = _autocast.any_autocast
