"""What the distillation losses (kl_div, jsd, tvd, fused_linear_jsd) share: argument checks, the
generalized JSD's per-element terms (the reference's, autograd-safe) and the magnitudes their
error models are relative to. Each op file keeps its own semantics (reference, tolerances); the
impls are the backends' (their manifests: :mod:`polykernel.backends`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from . import _checks as check

LABEL_DTYPES = (torch.int64, torch.int32)
# Rows of fp64 temporaries per step when an error model reads the inputs (the large GPU cases
# are 8192 x 128256: a few [rows, V] fp64 buffers at a time, never the whole [N, V]).
_MODEL_ELEMS = 1 << 24


def acc_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """fp32 math (fp64 stays fp64): the losses' dtype."""
    out = torch.float32
    for t in tensors:
        out = torch.promote_types(out, t.dtype)
    return out


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def plain(*tensors: torch.Tensor | None) -> bool:
    """Whether every tensor is a plain tensor (or None). The torch impls run the reference's plain
    torch ops on a tensor subclass (a DTensor, a wrapper): its own dispatch then sees every op,
    where their chunked loops would write it into plain buffers."""
    return all(t is None or type(t) in _PLAIN for t in tensors)


def rows_view(t: torch.Tensor) -> torch.Tensor:
    """``t [..., V]`` as ``[rows, V]`` (a view where the layout allows; V may be 0)."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def validate_pair(op: str, a_name: str, a: torch.Tensor, b_name: str, b: torch.Tensor, *, min_classes: int) -> None:
    """Two floating ``[..., V]`` tensors of one shape on one device (dtypes may differ)."""
    check.tensor(op, a_name, a)
    check.floating(op, a_name, a)
    if a.shape[-1] < min_classes:
        raise check.OpArgumentError(op, a_name, f"expected at least one class (last dim), got shape {tuple(a.shape)}")
    check.tensor(op, b_name, b)
    check.floating(op, b_name, b)
    if b.shape != a.shape:
        raise check.OpArgumentError(op, b_name, f"expected {a_name}'s shape {tuple(a.shape)}, got {tuple(b.shape)}")
    check.same_device(op, b_name, b, a_name, a)


def validate_labels(op: str, labels: torch.Tensor | None, rows_shape: torch.Size, ref_name: str, ref: torch.Tensor) -> None:
    """``labels``: None, or int64/int32 of the rows' shape (``ref``'s without its last dim). Any
    value other than ``ignore_index`` scores its row (labels are a mask here, never an index)."""
    if labels is None:
        return
    check.tensor(op, "labels", labels, min_dim=0)
    if labels.dtype not in LABEL_DTYPES:
        raise check.OpTypeError(op, "labels", f"expected an int64 or int32 tensor, got {labels.dtype}")
    if labels.shape != rows_shape:
        raise check.OpArgumentError(
            op, "labels", f"expected shape {tuple(rows_shape)} ({ref_name}'s shape without its last dim), got {tuple(labels.shape)}"
        )
    check.same_device(op, "labels", labels, ref_name, ref)


def validate_beta(op: str, beta: object) -> None:
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 <= beta <= 1.0:
        raise check.OpArgumentError(op, "beta", f"expected a number in [0, 1], got {check.shown(beta)}")


def labels_class(labels: torch.Tensor | None, rows_shape: torch.Size) -> tuple | None:
    """What an argument class holds of ``labels``: None, or (dtype, device, shape matches)."""
    if labels is None:
        return None
    return (labels.dtype, labels.device, labels.shape == rows_shape)


def scored(labels: torch.Tensor | None, ignore_index: int, rows: int) -> int:
    """How many rows count in the mean (host int; the error models and tests only)."""
    return rows if labels is None else int((labels != ignore_index).sum())


# -- the generalized JSD, element by element ---------------------------------------------------


def skip_ignored(valid: torch.Tensor, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensors [..., V]`` with the rows that ``valid [...]`` rejects read as zeros: an ignored
    row adds nothing and its gradient is exactly 0 even where its values are NaN or inf (a row
    masked after the math would carry 0·NaN = NaN back; ``cross_entropy``'s reference does so too)."""
    return tuple(torch.where(valid[..., None], t, 0.0) for t in tensors)


def jsd_terms(x: torch.Tensor, y: torch.Tensor, beta: float) -> torch.Tensor:
    """Per element of student log-probs ``x`` and teacher log-probs ``y``: the generalized JSD's
    term, differentiable in ``x`` with the exact derivative everywhere (the reference's).

    β = 0: ``P·(Y - X)`` (KL(P‖Q)); β = 1: ``Q·(X - Y)`` (KL(Q‖P)); else, with
    ``log M = log(β·P + (1-β)·Q)``, ``β·P·(Y - log M) + (1-β)·Q·(X - log M)``. A probability of
    exactly 0 contributes 0 (0·log 0 = 0, as in KL's definition): a masked vocabulary entry
    (-inf in both) adds nothing instead of NaN. Each masked branch sees finite stand-ins, so that
    autograd through ``torch.where`` gives 0, not NaN, there. NaN inputs stay NaN.
    """
    y = y.detach()
    p = y.exp()
    if beta == 0:
        live = p != 0
        return torch.where(live, p * (y - torch.where(live, x, 0.0)), 0.0)
    q = x.detach().exp()
    if beta == 1:
        live = q != 0
        xs, ys = torch.where(live, x, 0.0), torch.where(live, y, 0.0)
        return torch.where(live, xs.exp() * (xs - ys), 0.0)
    live_p, live_q = p != 0, q != 0
    either = live_p | live_q
    xm, ym = torch.where(either, x, 0.0), torch.where(either, y, 0.0)
    m = torch.maximum(xm, ym).detach()  # log M does not depend on the shift
    log_m = m + torch.log(beta * (ym - m).exp() + (1.0 - beta) * (xm - m).exp())
    xq = torch.where(live_q, x, 0.0)
    tp = torch.where(live_p, beta * p * (torch.where(live_p, y, 0.0) - log_m), 0.0)
    tq = torch.where(live_q, (1.0 - beta) * xq.exp() * (xq - log_m), 0.0)
    return tp + tq


def _row_chunks(*tensors: torch.Tensor) -> Iterator[tuple[torch.Tensor, ...]]:
    """The tensors' ``[rows, V]`` views in fp64, a few million elements at a time."""
    v = tensors[0].shape[-1]
    flat = [rows_view(t.detach()) for t in tensors]
    step = max(1, _MODEL_ELEMS // max(v, 1))
    for s in range(0, flat[0].shape[0], step):
        yield tuple(f[s : s + step].double() for f in flat)


def jsd_weights(xd: torch.Tensor, yd: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per element (fp64): the magnitudes (teacher part, student part) that a term's fp32 error
    is relative to. A term ``P·(Y - log M)`` is off by ~u·P·(1 + |Y|)·(|Y| + |log M| + 1): P's
    exp carries |Y|·u of relative error (GPUs evaluate exp2(Y·log2 e)), ``Y - log M`` cancels.
    The student part also bounds its derivative's error. Zero probabilities add 0."""
    p, q = yd.exp(), xd.exp()
    if beta == 0:
        wp, wq = p * (1 + yd.abs()) * (yd.abs() + xd.abs() + 1), p * (1 + yd.abs())
    elif beta == 1:
        wp, wq = torch.zeros_like(p), q * (1 + xd.abs()) * (xd.abs() + yd.abs() + 1)
    else:
        m = torch.maximum(xd, yd).nan_to_num(neginf=0.0)
        lm = (m + torch.log(beta * (yd - m).exp() + (1 - beta) * (xd - m).exp())).abs()
        wp = beta * p * (1 + yd.abs()) * (yd.abs() + lm + 1)
        wq = (1 - beta) * q * (1 + xd.abs()) * (xd.abs() + lm + 1)
    return torch.where(p == 0, 0.0, wp).nan_to_num(), torch.where(q == 0, 0.0, wq).nan_to_num()


def jsd_magnitudes(x: torch.Tensor, y: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row (fp64, on the CPU): Σ over V of the terms' magnitudes, and max over V of the
    student parts (:func:`jsd_weights`)."""
    sums, maxes = [], []
    for xd, yd in _row_chunks(x, y):
        wp, wq = jsd_weights(xd, yd, beta)
        sums.append((wp + wq).sum(-1).cpu())
        maxes.append((wq.amax(-1) if wq.shape[-1] else wq.sum(-1)).cpu())
    if not sums:
        return torch.zeros(0, dtype=torch.float64), torch.zeros(0, dtype=torch.float64)
    return torch.cat(sums), torch.cat(maxes)


def scored_rows(labels: torch.Tensor | None, ignore_index: int, rows: int) -> torch.Tensor:
    """A bool [rows] mask of the scored rows (on the CPU, for the error models)."""
    if labels is None:
        return torch.ones(rows, dtype=torch.bool)
    return (labels.detach().reshape(-1) != ignore_index).cpu()
