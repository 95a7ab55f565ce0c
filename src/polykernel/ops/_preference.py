"""Shared parts of the fused preference and RL losses (``fused_linear_{dpo,orpo,cpo,simpo,kto,grpo}_loss``):
argument checks, the float64 reference log-probs (:mod:`._preference_reference`), the chunking the
error models count on.

Every loss is a function of per-token log-probs ``logp[r, t] = log_softmax((hidden @ W.T + b) /
temperature)[target]`` (0 where the token is not scored). Its op file writes the loss once, as
``contrib(logp, *aux) -> per-unit terms`` whose sum is the loss (the normalisers, known before any
logit is computed, are folded in): the chunked impls call it per chunk of whole units, the
reference once on the whole batch.

The impls are the backends' (their manifests: :mod:`polykernel.backends`): each hands the op
file's ``chunked(head, ...)`` its :class:`Head`, the chunked linear + log-prob machinery (the
torch or the Triton per-token primitive over one chunked driver), so the formula is written once
and no op file names a backend.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from ..core.op import Case
from ..errors import OpArgumentError, OpTypeError
from . import _checks as check
from ._preference_reference import _capture, reference_token_logps  # noqa: F401  (the op files and the error model read them here)

CHUNK_BYTES = 1 << 30  # whole units per chunk up to this: fp32 logits plus dlogits (~1280 token rows at V = 128K, bf16)
SUB_BYTES = 256 << 20  # fp32 logits of one token sub-chunk of a unit whose G is kept (512 rows at V = 128K)


def unit_bytes(rows_per_unit: int, t: int, v: int, elt: int) -> int:
    """One unit's fp32 logits and its dlogits (``elt`` bytes): what the chunking budgets."""
    return rows_per_unit * t * v * (4 + elt)


def units_per_chunk(n_units: int, rows_per_unit: int, t: int, v: int, elt: int, budget: int = CHUNK_BYTES) -> int:
    """Whole units per chunk: their fp32 logits and dlogits (``elt`` bytes) within ``budget``,
    at least one unit, at most all of them. The impls' chunking (a unit is a pair or a
    sequence), which the error models count on: dW is accumulated once per chunk."""
    per_unit = max(1, unit_bytes(rows_per_unit, t, v, elt))
    n = max(1, min(n_units, budget // per_unit))
    if rows_per_unit * t == 1 and 256 <= n < n_units:  # one-token units: a multiple of 128 rows (matmul tiles)
        n -= n % 128
    return n


def keeps_g(n_units: int, rows_per_unit: int, t: int, v: int, elt: int, budget: int = CHUNK_BYTES, sub: int = SUB_BYTES) -> bool:
    """Whether the walk takes a unit's logits ``sub`` bytes at a time and keeps its
    ``G = softmax − onehot`` in the inputs' dtype (one more rounding of each gradient) rather than
    its whole fp32 logits and dlogits: for a unit over ``budget``, and for 16-bit units alone in
    their chunk whose fp32 logits exceed ``sub`` (there G plus one sub-chunk is the smaller:
    KTO's 1024-token sequence at V = 128K holds 0.5 GB where it held 0.79). fp32 units below the
    budget gain nothing (their dlogits overwrite their logits) and stay in one pass."""
    if unit_bytes(rows_per_unit, t, v, elt) > budget:
        return True
    return elt < 4 and units_per_chunk(n_units, rows_per_unit, t, v, elt, budget) == 1 and 4 * rows_per_unit * t * v > sub


class Head(Protocol):
    """What an impl hands a loss's ``chunked``: per-token log-probs of an LM head, chunked, with
    their gradients (``polykernel.backends._linear_logps.Head``)."""

    def run(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor, ignore_index: int,
            temperature: float, pairs: bool, contrib: Callable[..., torch.Tensor],
            aux: Sequence[torch.Tensor | None] = ()) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """``(loss, logps [R, T])``: the sum of ``contrib``'s per-unit terms (differentiable in
        hidden, weight, bias) and the detached per-token log-probs (0 where ignored)."""
        ...

    def logps_only(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
                   ignore_index: int) -> torch.Tensor:  # fmt: skip
        """Per-token log-probs ``[R, T]`` (0 where ignored) without gradients (a reference model's)."""
        ...


def sequence_logps(logp: torch.Tensor, mask: torch.Tensor, average: bool) -> torch.Tensor:
    """Per-row sum of the scored tokens' log-probs, or their mean (0/0 = NaN for a row with none)."""
    s = logp.sum(-1)
    return s / mask.sum(-1) if average else s


# -- argument checks ------------------------------------------------------------------------------


def validate_head(
    op: str, hidden: Any, weight: Any, bias: Any, target: Any, *, names: tuple[str, ...] = ("hidden", "weight", "bias", "target")
) -> None:
    """hidden ``[R, T, H]`` floating, weight ``[V, H]`` (hidden's dtype and device), bias ``[V]``
    or None, target ``[R, T]`` integer (the ids' range: :func:`validate_targets`)."""
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
    """Every scored id in [0, V) (a host sync: a clear error, never an out-of-bounds read).
    Under torch.compile the eager call behind the graph break checks them (``compile_mode``
    "eager" validates every call), not the trace."""
    if torch.compiler.is_compiling():
        return
    bad = (target < 0) | (target >= v)
    if ignore_index is not None:
        bad &= target != ignore_index
    if target.numel() and bool(bad.any()):  # the one sync; the message's lookup only on error
        raise OpArgumentError(op, name, f"expected token ids in [0, {v}) or ignore_index, got {target[bad][0].item()}")


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


def validate_smoothing(op: str, value: Any) -> None:
    check.finite_float(op, "label_smoothing", value)
    if not 0.0 <= float(value) <= 0.5:
        raise OpArgumentError(op, "label_smoothing", f"expected a number in [0, 0.5], got {check.shown(value)}")


# -- running a loss -------------------------------------------------------------------------------


def reference_run(hidden, weight, bias, target, ignore_index: int, fn, aux, temperature: float = 1.0):
    """``(loss, logps)`` of the same formula on the float64 full logits (differentiable loss)."""
    logps = reference_token_logps(hidden, weight, bias, target, ignore_index, temperature)
    return fn(logps, *aux).sum(), logps.detach()


def ref_sequence_logps(head: Head | None, ref_hidden, ref_weight, ref_bias, target, ignore_index: int, average: bool) -> torch.Tensor:
    """A reference head's per-sequence log-probs (no gradient), chunked through ``head`` (None:
    in float64 from the full logits, the reference's)."""
    mask = target != ignore_index
    with torch.no_grad():
        if head is None:
            tok = reference_token_logps(ref_hidden, ref_weight, ref_bias, target, ignore_index)
        else:
            tok = head.logps_only(ref_hidden, ref_weight, ref_bias, target, ignore_index)
        return sequence_logps(tok, mask, average)


def nll_terms(logp: torch.Tensor, n_tokens: torch.Tensor) -> torch.Tensor:
    """Per-pair terms of the chosen rows' token-mean NLL (rows ``[chosen k; rejected k]``)."""
    return -logp[: logp.shape[0] // 2].sum(-1) / n_tokens


def validate_pairwise(op: str, hidden, weight, target, bias, beta, ignore_index) -> None:
    validate_head(op, hidden, weight, bias, target)
    validate_pairs(op, "hidden", hidden)
    validate_beta(op, beta)
    check.ignore_index(op, ignore_index, "target", target)
    validate_targets(op, "target", target, weight.shape[0], ignore_index)


# -- the pairwise losses' statistics (rows ``[chosen B; rejected B]``) ---------------------------------


def pair_logps(logp: torch.Tensor, mask: torch.Tensor, average: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The chosen and the rejected sequences' log-probs ``c, r`` (sums, or means with ``average``)."""
    seq = sequence_logps(logp, mask, average)
    k = seq.shape[0] // 2
    return seq[:k], seq[k:]


def chosen_nll(logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The chosen rows' token-mean NLL (NaN when none of their tokens is scored), a statistic
    without gradient."""
    b = mask.shape[0] // 2
    with torch.no_grad():
        return -logps[:b].sum() / mask[:b].sum()


def pair_stats(loss: torch.Tensor, logps: torch.Tensor, mask: torch.Tensor, beta: float, average: bool) -> tuple:
    """``(loss, c, r, β·c, β·r)``: the leading fields of the outputs of the pairwise losses
    without a reference model (CPO, SimPO, ORPO), the statistics without gradient."""
    with torch.no_grad():
        c, r = pair_logps(logps, mask, average)
        return loss, c, r, beta * c, beta * r


# -- the Op declarations' shared parts ------------------------------------------------------------


def acc_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The outputs' dtype: fp32 (fp64 for fp64 inputs)."""
    return torch.promote_types(hidden.dtype, torch.float32)


def contract(out: Any, hidden: torch.Tensor) -> Any:
    """The reference's outputs in the contract's dtype (``acc_dtype``), NamedTuples kept: the
    float64 formula stays differentiable through the cast."""
    acc = acc_dtype(hidden)

    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.to(acc) if x.is_floating_point() else x
        if isinstance(x, tuple) and hasattr(x, "_fields"):
            return type(x)(*map(cast, x))
        return x

    return cast(out)


# The head's widths, as the class holds them: a weight's (and bias's) whole shape, a hidden
# state's last dimension; every other size is the batch's (pairs, sequences, tokens), which
# changes step to step (GRPO's completion lengths) and no impl's choice depends on.
_WIDTHS = {"weight": 0, "bias": 0, "ref_weight": 0, "ref_bias": 0, "hidden": -1, "ref_hidden": -1}


def _describe(a: Any, name: str | None = None) -> Any:
    """A tensor by its shape (the batch's sizes as None: see ``_WIDTHS``), dtype, device and
    requires_grad; an option by value."""
    if isinstance(a, torch.Tensor):
        keep = _WIDTHS.get(name) if name is not None else 0
        shape = tuple(a.shape) if keep == 0 else (*[None] * (a.dim() - 1), a.shape[-1]) if keep == -1 and a.dim() else (None,) * a.dim()
        return (shape, a.dtype, a.device, a.requires_grad)
    return a


def arg_key(*args: Any, names: Sequence[str] | None = None) -> tuple:
    """The argument class: hidden's device and dtype, whether a gradient is wanted, then every
    argument (a tensor by its rank, the head's widths, dtype, device and requires_grad, without
    the batch's sizes; an option by value). The public functions validate every call themselves
    (shapes that disagree, the token ids' range), so this class only has to tell impls'
    refusals apart, and one class serves every batch and sequence length. ``names``: the
    arguments' parameter names (without them every tensor's whole shape is kept)."""
    hidden = args[0]
    floats = [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
    described = map(_describe, args, names) if names is not None else map(_describe, args)
    return (hidden.device, hidden.dtype, check.needs_grad(*floats), *described)


def key_for(reference: Any) -> Any:
    """``Op(key=)``: :func:`arg_key` on the arguments bound to the reference's parameters
    (``explain`` passes the options by name), defaults filled in."""
    import inspect

    sig = inspect.signature(reference)
    names = tuple(sig.parameters)

    def key(*args: Any, **kwargs: Any) -> tuple:
        if kwargs or len(args) != len(sig.parameters):
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            args = tuple(bound.arguments.values())
        return arg_key(*args, names=names)

    return key


def default_key(n_args: int):
    """``Op(default_key=)`` for ``n_args`` positional arguments (unknown: None)."""
    return lambda device, dtype: (device, dtype, False, *([None] * n_args))


def fields(reference: Any) -> tuple[str, ...]:
    """``Op(fields=)``: device, dtype, needs_grad, then the reference's parameters."""
    import inspect

    return ("device", "dtype", "needs_grad", *inspect.signature(reference).parameters)


DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LARGE_SHAPE = (8, 1024, 2048, 128256)  # the 1B-model shape: 8 sequences of 1024 tokens, H = 2048, V = 128256


def op_fields(reference: Any, moved: Callable[..., int] | None = None) -> dict[str, Any]:
    """The ``Op(...)`` fields the six losses share: the argument class from the reference's
    parameters (:func:`fields`, :func:`key_for`, :func:`default_key`), the dtypes, the policy
    head's :func:`bytes_moved` (``moved``: the op's own, with a reference head), and ``compile_mode="eager"``: under torch.compile, a graph break
    around the eager dispatcher (NamedTuple outputs have no custom-op schema; Inductor's code for
    the float64 reference would hold the [N, V] logits)."""
    import inspect

    n_args = len(inspect.signature(reference).parameters)
    return {"fields": fields(reference), "key": key_for(reference), "default_key": default_key(n_args), "dtypes": DTYPES,
            "bytes_moved": moved or bytes_moved, "compile_mode": "eager"}  # fmt: skip


def pair_outputs(n_scalars: int) -> Any:
    """``Op(outputs=)`` of a pairwise loss, from the impl's arguments without running it: the 0-d
    loss, four ``[B]`` statistics (the chosen and rejected log-probs and rewards), then
    ``n_scalars`` 0-d ones, all in :func:`acc_dtype`."""

    def outputs(hidden: torch.Tensor, *_: object) -> tuple[tuple[torch.Size, torch.dtype], ...]:
        acc, b = acc_dtype(hidden), torch.Size((hidden.shape[0] // 2,))
        return ((torch.Size(), acc), *[(b, acc)] * 4, *[(torch.Size(), acc)] * n_scalars)

    return outputs


# -- cases, bench ---------------------------------------------------------------------------------


def case_head(r: int, t: int, h: int, v: int, *, device: Any, dtype: torch.dtype, grad: bool = True, ignored: float = 0.2,
              bias: bool = True) -> tuple:  # fmt: skip
    """``(hidden [r, t, h], weight [v, h], target [r, t], bias [v])``: logits of a few units'
    spread, ``ignored`` of the targets -100."""
    hid = torch.randn(r, t, h, device=device).to(dtype).requires_grad_(grad)
    w = (2 * torch.randn(v, h, device=device) / h**0.5).to(dtype).requires_grad_(grad)
    tg = torch.randint(0, v, (r, t), device=device).masked_fill(torch.rand(r, t, device=device) < ignored, -100)
    b = (0.1 * torch.randn(v, device=device)).to(dtype).requires_grad_(grad) if bias else None
    return hid, w, tg, b


def example_head(shape: tuple[int, ...], dtype: torch.dtype, device: Any, requires_grad: bool) -> tuple:
    """``shape`` = (R, T, H, V): unit-variance logits, ~5% of the targets ignored, no bias."""
    r, t, h, v = shape
    hid = torch.randn(r, t, h, device=device).to(dtype).requires_grad_(requires_grad)
    w = (torch.randn(v, h, device=device) / h**0.5).to(dtype).requires_grad_(requires_grad)
    tg = torch.randint(0, v, (r, t), device=device).masked_fill(torch.rand(r, t, device=device) < 0.05, -100)
    return hid, w, tg


def pair_example(shape: tuple[int, ...], dtype: torch.dtype, device: Any, requires_grad: bool = False) -> Case:
    """``Op(example=)`` of a pairwise loss: ``shape`` = (2B, T, H, V), B pairs of T tokens, ~5%
    of the targets ignored."""
    return Case("x".join(map(str, shape)), example_head(shape, dtype, device, requires_grad))


def flops(hidden: torch.Tensor, weight: torch.Tensor, *_: object, backward: bool = False, **__: object) -> int:
    """Matmul FLOPs of the policy's head: 2·N·H·V forward, 6·N·H·V with dH and dW."""
    n, (v, h) = hidden.numel() // max(hidden.shape[-1], 1), weight.shape
    return (6 if backward else 2) * n * h * v


def bytes_moved(hidden: torch.Tensor, weight: torch.Tensor, *_: object, backward: bool = False, **__: object) -> int:
    """Fewest bytes: read hidden and weight (+ write dH and dW). Matmul-bound: rate by ``flops``."""
    size = hidden.numel() * hidden.element_size() + weight.numel() * weight.element_size()
    return 2 * size if backward else size


def with_ref_head(ref_at: int) -> tuple[Callable[..., int], Callable[..., int]]:
    """``flops`` and ``bytes_moved`` of a loss that takes a reference model's head (DPO, KTO):
    ``ref_hidden``/``ref_weight`` at positions ``ref_at``, ``ref_at + 1`` of the reference (or
    by name). When given, the call also runs that head forward, without gradient: its logits'
    2·N·Hr·V FLOPs, and ref_hidden and ref_weight read once, in both modes."""

    def ref(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor] | None:
        at = ref_at - 2  # args holds what follows hidden and weight
        rh = args[at] if len(args) > at else kwargs.get("ref_hidden")
        rw = args[at + 1] if len(args) > at + 1 else kwargs.get("ref_weight")
        return (rh, rw) if isinstance(rh, torch.Tensor) and isinstance(rw, torch.Tensor) else None

    def ref_flops(hidden: torch.Tensor, weight: torch.Tensor, *args: Any, backward: bool = False, **kwargs: Any) -> int:
        r = ref(args, kwargs)
        return flops(hidden, weight, backward=backward) + (0 if r is None else flops(*r))

    def ref_bytes(hidden: torch.Tensor, weight: torch.Tensor, *args: Any, backward: bool = False, **kwargs: Any) -> int:
        r = ref(args, kwargs)
        return bytes_moved(hidden, weight, backward=backward) + (0 if r is None else bytes_moved(*r))

    return ref_flops, ref_bytes
