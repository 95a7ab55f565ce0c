"""Shared parts of the fused preference and RL losses (``fused_linear_{dpo,orpo,cpo,simpo,kto,grpo}_loss``):
argument checks, the float64 reference log-probs, the impl choice.

Every loss is a function of per-token log-probs ``logp[r, t] = log_softmax((hidden @ W.T + b) /
temperature)[target]`` (0 where the token is not scored). Its op file writes the loss once, as
``contrib(logp, *aux) -> per-unit terms`` whose sum is the loss (the normalisers, known before any
logit is computed, are folded in): the chunked impls call it per chunk of whole units, the
reference once on the whole batch.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import ImplNotAvailableError, OpArgumentError, OpTypeError
from . import _checks as check

IMPLS = ("torch", "triton", "liger")


def reference_token_logps(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    ignore_index: int,
    temperature: float = 1.0,
) -> torch.Tensor:
    """``[R, T]`` log-probs from the full ``[R, T, V]`` logits in float64 (differentiable), 0 where
    ``target == ignore_index``: the semantics the chunked impls are checked against."""
    f64 = torch.float64
    z = F.linear(hidden.to(f64), weight.to(f64), None if bias is None else bias.to(f64)) / temperature
    valid = target != ignore_index
    lp = z.log_softmax(-1).gather(-1, torch.where(valid, target, 0)[..., None]).squeeze(-1)
    return torch.where(valid, lp, 0.0)


def sequence_logps(logp: torch.Tensor, mask: torch.Tensor, average: bool) -> torch.Tensor:
    """Per-row sum of the scored tokens' log-probs, or their mean (0/0 = NaN for a row with none)."""
    s = logp.sum(-1)
    return s / mask.sum(-1) if average else s


# -- argument checks ------------------------------------------------------------------------------


def validate_head(op: str, hidden: Any, weight: Any, bias: Any, target: Any, *, names: tuple[str, ...] = ("hidden", "weight", "bias", "target"),
                  target_dtypes: str = "integer") -> None:  # fmt: skip
    """hidden ``[R, T, H]`` floating, weight ``[V, H]`` (hidden's dtype and device), bias ``[V]``
    or None, target ``[R, T]`` integer; every scored target in ``[0, V)`` (one host sync)."""
    hn, wn, bn, tn = names
    check.tensor(op, hn, hidden)
    check.floating(op, hn, hidden)
    if hidden.dim() != 3:
        raise OpArgumentError(op, hn, f"expected [B, T, H] hidden states (rank 3), got shape {tuple(hidden.shape)}")
    check.tensor(op, wn, weight)
    check.floating(op, wn, weight)
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise OpArgumentError(op, wn, f"expected shape (V, {hidden.shape[-1]}) to match {hn}'s last dim, got {tuple(weight.shape)}")
    if weight.shape[0] == 0:
        raise OpArgumentError(op, wn, "expected at least one class (V >= 1), got V = 0")
    if weight.dtype != hidden.dtype:
        raise OpTypeError(op, wn, f"expected {hn}'s dtype {hidden.dtype}, got {weight.dtype}")
    check.same_device(op, wn, weight, hn, hidden)
    if bias is not None:
        check.tensor(op, bn, bias)
        check.floating(op, bn, bias)
        if tuple(bias.shape) != (weight.shape[0],):
            raise OpArgumentError(op, bn, f"expected shape ({weight.shape[0]},) (one per class), got {tuple(bias.shape)}")
        check.same_device(op, bn, bias, hn, hidden)
    check.tensor(op, tn, target)
    if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        raise OpTypeError(op, tn, f"expected an integer tensor of token ids, got {target.dtype}")
    if tuple(target.shape) != tuple(hidden.shape[:2]):
        raise OpArgumentError(op, tn, f"expected {hn}'s [B, T] = {tuple(hidden.shape[:2])}, got {tuple(target.shape)}")
    check.same_device(op, tn, target, hn, hidden)


def validate_targets(op: str, name: str, target: torch.Tensor, v: int, ignore_index: int | None) -> None:
    """Every scored id in [0, V) (a host sync: a clear error, never an out-of-bounds read)."""
    scored = target if ignore_index is None else target[target != ignore_index]
    if scored.numel() and bool(((scored < 0) | (scored >= v)).any()):
        bad = scored[(scored < 0) | (scored >= v)][0].item()
        raise OpArgumentError(op, name, f"expected token ids in [0, {v}) or ignore_index, got {bad}")


def validate_pairs(op: str, name: str, hidden: torch.Tensor) -> None:
    """The pairwise layout: an even, non-zero batch (the first half chosen, the second rejected)."""
    b = hidden.shape[0]
    if b == 0 or b % 2:
        raise OpArgumentError(op, name, f"expected a batch of 2B rows (B chosen, then B rejected), got {b}")


def validate_ref_head(
    op: str, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ref_hidden: Any, ref_weight: Any, ref_bias: Any
) -> None:
    """A reference model's head: ref_hidden ``[B, T, Hr]`` with ref_weight ``[V, Hr]`` (the
    policy's vocabulary), both or neither."""
    if (ref_hidden is None) != (ref_weight is None):
        raise OpArgumentError(op, "ref_weight" if ref_weight is None else "ref_hidden", "ref_hidden and ref_weight come together")
    if ref_hidden is None:
        if ref_bias is not None:
            raise OpArgumentError(op, "ref_bias", "given without ref_hidden and ref_weight")
        return
    validate_head(op, ref_hidden, ref_weight, ref_bias, target, names=("ref_hidden", "ref_weight", "ref_bias", "target"))
    if tuple(ref_hidden.shape[:2]) != tuple(hidden.shape[:2]):
        raise OpArgumentError(op, "ref_hidden", f"expected hidden's [B, T] = {tuple(hidden.shape[:2])}, got {tuple(ref_hidden.shape[:2])}")
    if ref_weight.shape[0] != weight.shape[0]:
        raise OpArgumentError(op, "ref_weight", f"expected the policy's vocabulary V = {weight.shape[0]}, got {ref_weight.shape[0]}")
    check.same_device(op, "ref_hidden", ref_hidden, "hidden", hidden)


def validate_vector(op: str, name: str, value: Any, n: int, hidden: torch.Tensor, what: str = "one per sequence") -> None:
    """A floating ``[n]`` tensor on hidden's device."""
    check.tensor(op, name, value)
    check.floating(op, name, value)
    if tuple(value.shape) != (n,):
        raise OpArgumentError(op, name, f"expected shape ({n},) ({what}), got {tuple(value.shape)}")
    check.same_device(op, name, value, "hidden", hidden)


def validate_beta(op: str, beta: Any) -> None:
    check.nonnegative_float(op, "beta", beta)
    check.finite_float(op, "beta", beta)


def validate_ignore_index(op: str, ignore_index: Any) -> None:
    check.int64(op, "ignore_index", ignore_index)


def validate_smoothing(op: str, value: Any) -> None:
    check.finite_float(op, "label_smoothing", value)
    if not 0.0 <= float(value) <= 0.5:
        raise OpArgumentError(op, "label_smoothing", f"expected a number in [0, 0.5], got {value!r}")


# -- impl choice ----------------------------------------------------------------------------------


def primitive(op: str, impl: str | None, hidden: torch.Tensor) -> ModuleType:
    """The per-token log-prob primitive of ``impl`` (torch or triton); default: Triton on CUDA in
    fp32/bf16/fp16, torch elsewhere. ``impl="liger"`` is the op file's own path."""
    if impl is not None and impl not in IMPLS:
        raise OpArgumentError(op, "impl", f"expected one of {', '.join(map(repr, IMPLS))} or None, got {impl!r}")
    if impl is None:
        impl = "triton" if hidden.device.type == "cuda" and hidden.dtype != torch.float64 else "torch"
    if impl == "triton":
        if hidden.dtype == torch.float64:
            raise ImplNotAvailableError(op, "triton", "dtype float64 not supported (fp32 math); use impl='torch'", ["torch"])
        return importlib.import_module("polykernel.backends.triton._token_logps")
    return importlib.import_module("polykernel.backends.torch._token_logps")


def liger(op: str) -> ModuleType:
    """The Liger adapters' module (``polykernel.backends.liger.preference``), imported on first use."""
    try:
        return importlib.import_module("polykernel.backends.liger.preference")
    except ImportError as exc:
        raise ImplNotAvailableError(op, "liger", f"liger_kernel is not importable ({exc})", ["torch", "triton"]) from None


# -- running a loss -------------------------------------------------------------------------------


def run(op: str, impl: str | None, hidden, weight, bias, target, ignore_index: int, pairs: bool, fn, aux, temperature: float = 1.0):
    """``(loss, logps [R, T])`` through the chunked driver with ``impl``'s primitive."""
    from ..backends.torch import _linear_logps as walker  # (the driver: backends sit beside ops)

    return walker.run(primitive(op, impl, hidden), hidden, weight, bias, target, ignore_index, temperature, pairs, fn, aux)


def reference_run(hidden, weight, bias, target, ignore_index: int, fn, aux, temperature: float = 1.0):
    """``(loss, logps)`` of the same formula on the float64 full logits (differentiable loss)."""
    logps = reference_token_logps(hidden, weight, bias, target, ignore_index, temperature)
    return fn(logps, *aux).sum(), logps.detach()


def ref_sequence_logps(op: str, impl: str | None, ref_hidden, ref_weight, ref_bias, target, ignore_index: int, average: bool,
                       *, exact: bool = False) -> torch.Tensor:  # fmt: skip
    """A reference head's per-sequence log-probs (no gradient), chunked (or float64 with ``exact``)."""
    mask = target != ignore_index
    with torch.no_grad():
        if exact:
            tok = reference_token_logps(ref_hidden, ref_weight, ref_bias, target, ignore_index)
        else:
            from ..backends.torch import _linear_logps as walker

            prim = primitive(op, "torch" if impl == "liger" else impl, ref_hidden)
            tok = walker.logps_only(prim, ref_hidden, ref_weight, ref_bias, target, ignore_index)
        return sequence_logps(tok, mask, average)


def nll_terms(logp: torch.Tensor, n_tokens: torch.Tensor) -> torch.Tensor:
    """Per-pair terms of the chosen rows' token-mean NLL (rows ``[chosen k; rejected k]``)."""
    return -logp[: logp.shape[0] // 2].sum(-1) / n_tokens


def validate_pairwise(op: str, hidden, weight, target, bias, beta, ignore_index) -> None:
    validate_head(op, hidden, weight, bias, target)
    validate_pairs(op, "hidden", hidden)
    validate_beta(op, beta)
    validate_ignore_index(op, ignore_index)
    validate_targets(op, "target", target, weight.shape[0], ignore_index)
