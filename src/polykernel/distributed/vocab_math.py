"""The math of a vocab-parallel cross-entropy on one rank's vocab slice (:mod:`polykernel.distributed.vocab`):
each rank's statistics of its logits, the one collective that combines them, and the losses and
logit gradients from the combined statistics. ``polykernel.distributed.vocab`` re-exports these names."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .layout import mean_divisor

N_STATS = 3  # the slice's lse, target logit, Σ w·z


@dataclass(frozen=True)
class Options:
    ignore_index: int = -100
    label_smoothing: float = 0.0
    reduction: str = "mean"
    softcap: float | None = None
    z_loss: float = 0.0


def _capped(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    return x if not cap else cap * torch.tanh(x / cap)


def local_stats(z: torch.Tensor, t: torch.Tensor, lo: int, w_local: torch.Tensor | None, smoothing: bool) -> torch.Tensor:
    """``[rows, N_STATS]`` statistics of capped fp32 logits ``z [rows, V_local]`` (columns
    ``lo:lo+V_local`` of the vocabulary) for targets ``t``."""
    rows, vl = z.shape
    out = torch.zeros(rows, N_STATS, dtype=z.dtype, device=z.device)
    if vl == 0:  # an empty slice (V < world size): contributes nothing
        out[:, 0] = -torch.inf
        return out
    out[:, 0] = torch.logsumexp(z, -1)  # the slice's lse (one fused pass; no [rows, V_local] temporary)
    owned = (t >= lo) & (t < lo + vl)
    idx = (t - lo).clamp(0, vl - 1)
    out[:, 1] = torch.where(owned, z.gather(1, idx[:, None]).squeeze(1), 0.0)
    if smoothing:
        out[:, 2] = z.sum(-1) if w_local is None else z @ w_local.to(z.dtype)
    return out


def combine(gathered: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From the ranks' ``[W, rows, N_STATS]`` statistics: the global lse, target logit and Σ w·z."""
    # the log-sum-exp of the slices' lse's (exact: logsumexp subtracts their max; -inf for an empty slice)
    return torch.logsumexp(gathered[..., 0], 0), gathered[..., 1].sum(0), gathered[..., 2].sum(0)


def _row_weights(t: torch.Tensor, o: Options, v: int, cw: torch.Tensor | None, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: ``w[t]`` (0 for ignored rows) and a NaN flag for targets out of range (no impl
    returns a finite loss from an out-of-range target)."""
    valid = t != o.ignore_index
    bad = valid & ((t < 0) | (t >= v))
    if cw is None:
        wt = valid.to(dtype)
    else:
        wt = torch.where(valid & ~bad, cw.to(dtype)[t.clamp(0, v - 1)], 0.0)
    return wt, bad


def row_losses(
    lse: torch.Tensor, zt: torch.Tensor, sz: torch.Tensor, t: torch.Tensor, o: Options, v: int, cw: torch.Tensor | None
) -> torch.Tensor:
    """Per-row loss from the global statistics (0 on ignored rows, NaN on out-of-range targets)."""
    eps = o.label_smoothing
    wt, bad = _row_weights(t, o, v, cw, lse.dtype)
    valid = (t != o.ignore_index).to(lse.dtype)
    loss = (1 - eps) * wt * (lse - zt)
    if eps:
        wsum = float(v) if cw is None else cw.to(lse.dtype).sum()
        loss = loss + (eps / v) * (wsum * lse - sz) * valid
    if o.z_loss:
        loss = loss + o.z_loss * wt * lse * lse  # weighted like the loss: one denominator
    return torch.where(bad, torch.nan, torch.where(valid > 0, loss, 0.0))


def divisor(t: torch.Tensor, o: Options, v: int, cw: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``[what "mean" divides the sum by (Σ w[t] over the scored rows, NaN where that is 0:
    :func:`~polykernel.distributed.layout.mean_divisor`; their count without class weights), the
    count of scored rows]``. Every rank holds all the targets: the sums are global."""
    count = (t != o.ignore_index).sum().to(dtype)
    return torch.stack([count if cw is None else mean_divisor(_row_weights(t, o, v, cw, dtype)[0].sum()), count])


def grad_logits(
    x: torch.Tensor,
    lse: torch.Tensor,
    t: torch.Tensor,
    lo: int,
    coef: torch.Tensor,
    o: Options,
    v: int,
    cw: torch.Tensor | None,
    inplace: bool = False,
) -> torch.Tensor:
    """d(Σ coef·loss)/dx on a slice: ``x [rows, V_local]`` the raw local logits (fp32), ``coef``
    per row. ``inplace``: ``x`` is a scratch buffer of the caller's, overwritten with the result
    (no [rows, V_local] temporary)."""
    vl = x.shape[1]
    if vl == 0:
        return x.clone()
    z = _capped(x, o.softcap)
    chain = 1 - (z / o.softcap) ** 2 if o.softcap else None
    buf = z if (inplace or o.softcap) else z.clone()  # a soft-capped z is this function's own
    eps = o.label_smoothing
    wt, bad = _row_weights(t, o, v, cw, x.dtype)
    valid = (t != o.ignore_index).to(x.dtype)
    # ignored rows: 0 whatever coef is (NaN or inf from a zero divisor, a NaN cotangent), as torch
    c = torch.where(bad, torch.nan, torch.where(valid > 0, coef, 0.0))
    p_scale = (1 - eps) * wt
    if eps:
        p_scale = p_scale + (eps / v) * (float(v) if cw is None else cw.to(x.dtype).sum())
    if o.z_loss:
        p_scale = p_scale + 2 * o.z_loss * wt * lse
    dz = buf.sub_(lse[:, None]).exp_().mul_((c * p_scale)[:, None])  # p·scale, in place
    owned = (t >= lo) & (t < lo + vl)
    idx = (t - lo).clamp(0, vl - 1)
    dz.scatter_add_(1, idx[:, None], torch.where(owned, -(1 - eps) * wt * c, 0.0)[:, None])
    if eps:
        w_local = torch.ones(vl, dtype=x.dtype, device=x.device) if cw is None else cw[lo : lo + vl].to(x.dtype)
        dz.addr_(c, w_local, alpha=-eps / v)
    if chain is not None:
        dz.mul_(chain)
    return dz


def reduce(losses: torch.Tensor, den: torch.Tensor, reduction: str, shape: Sequence[int]) -> torch.Tensor:
    if reduction == "none":
        return losses.reshape(tuple(shape))
    total = losses.sum()
    if reduction == "sum":
        return total
    scored = den[1] > 0  # nothing scored: NaN; scored rows whose weights sum to 0: total / NaN (divisor)
    return torch.where(scored, total / torch.where(scored, den[0], 1.0), torch.nan)


def loss_stats(group: Any, stats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The one collective: every rank's ``[rows, N_STATS]`` statistics, combined."""
    return combine(_all_gather(stats, group))


def _all_gather(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Every rank's ``x`` (same shape on all), as ``[world, *x.shape]``: one collective."""
    world = dist.get_world_size(group)
    out = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    gather(out, x.contiguous(), group=group)
    return out.view(world, *x.shape)
