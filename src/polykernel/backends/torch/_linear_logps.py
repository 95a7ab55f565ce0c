"""The chunked driver of the fused preference/RL losses: per-token log-probs of an LM head and
their gradients, never the ``[N, V]`` logits of the whole batch.

The losses (``polykernel.ops.fused_linear_*_loss``) are sums of per-unit terms (a unit is a
chosen/rejected pair or one sequence) whose normalisers (pair counts, mask sums) are known
before any logit is computed. So the walk takes whole units per chunk and, per chunk of rows::

    z    = (hidden[c] @ W.T + b) / temperature          (fp32 result of the inputs' values)
    logp = z[t] − lse(z)                                 (the primitive: torch or Triton)
    part = contrib(logp, aux[c])                         (the loss's own torch code, tiny [r, T], float64)
    d    = ∂ part.sum() / ∂ logp                         (autograd over the [r, T] log-probs only)
    dz   = −d/temperature · (softmax(z) − onehot(t))     (the primitive, into the inputs' dtype)
    grad_hidden[c] = dz @ W;  grad_weight += dz.T @ hidden[c];  grad_bias += Σ dz

No per-sequence statistic couples two chunks: a chunk holds whole pairs (both rows of a pair)
or whole sequences (GRPO's sequence-level importance ratio is a statistic of one sequence).
The forward stores the gradients for a unit cotangent; the backward scales them by it, so the
graph can be back-propagated once. Peak extra memory: one chunk's fp32 logits and its dlogits
(``CHUNK_BYTES``, at least one unit: a pair of T-token rows), besides the gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType

import torch

from .fused_linear_jsd import projector

CHUNK_BYTES = 1 << 30  # one chunk's fp32 logits plus its dlogits (two pairs of 1024 tokens at V = 128K, bf16)

Contrib = Callable[..., torch.Tensor]


def units_per_chunk(n_units: int, rows_per_unit: int, t: int, v: int, elt: int, budget: int = CHUNK_BYTES) -> int:
    """Whole units per chunk: their fp32 logits and dlogits (``elt`` bytes) within ``budget``,
    at least one unit, at most all of them."""
    per_unit = max(1, rows_per_unit * t * v * (4 + elt))
    return max(1, min(n_units, budget // per_unit))


def _chunks(n_rows: int, pairs: bool, step: int) -> list[list[slice]]:
    """The row slices of each chunk: ``[u0:u1]`` (and ``[B+u0:B+u1]``, the rejected rows of the
    same pairs, for the pairwise losses)."""
    units = n_rows // 2 if pairs else n_rows
    out = []
    for u0 in range(0, units, step):
        u1 = min(units, u0 + step)
        out.append([slice(u0, u1), slice(units + u0, units + u1)] if pairs else [slice(u0, u1)])
    return out


def _take(x: torch.Tensor, rows: list[slice]) -> torch.Tensor:
    return x[rows[0]] if len(rows) == 1 else torch.cat([x[r] for r in rows])


def _logits(proj, hc: torch.Tensor, bias: torch.Tensor | None, inv_t: float) -> torch.Tensor:
    z = proj(hc)
    if bias is not None:
        z.add_(bias.to(z.dtype))
    if inv_t != 1.0:
        z.mul_(inv_t)
    return z


def walk(
    prim: ModuleType,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    ignore_index: int,
    temperature: float,
    pairs: bool,
    contrib: Contrib | None,
    aux: Sequence[torch.Tensor | None] = (),
    needs: tuple[bool, bool, bool] = (False, False, False),
    budget: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """One walk: ``(loss, logps [R, T], grad_hidden, grad_weight, grad_bias)`` with ``loss`` the
    sum of ``contrib``'s per-unit terms (0 without ``contrib``) and the gradients that ``needs``
    asks for (hidden, weight, bias), for a unit cotangent. ``aux``: per-row tensors ``[R, ...]``
    that ``contrib`` takes after the chunk's log-probs, sliced like them."""
    r, t, h = hidden.shape
    v = weight.shape[0]
    dev = hidden.device
    acc = torch.promote_types(hidden.dtype, torch.float32)
    logps = torch.zeros((r, t), dtype=acc, device=dev)
    loss = torch.zeros((), dtype=acc, device=dev)
    grads = contrib is not None and any(needs)
    gh = torch.zeros((r, t, h), dtype=hidden.dtype, device=dev) if grads and needs[0] else None
    gw = torch.zeros((v, h), dtype=weight.dtype, device=dev) if grads and needs[1] else None
    gb = torch.zeros(v, dtype=acc, device=dev) if grads and needs[2] and bias is not None else None
    proj = projector(weight)
    inv_t = 1.0 / temperature
    budget = CHUNK_BYTES if budget is None else budget  # read per call: tests shrink it
    step = units_per_chunk(r // 2 if pairs else r, 2 if pairs else 1, t, v, hidden.element_size(), budget)
    for rows in _chunks(r, pairs, step):
        nr = sum(s.stop - s.start for s in rows)
        hc = _take(hidden, rows).reshape(-1, h)
        tc = _take(target, rows).reshape(-1)
        z = _logits(proj, hc, bias, inv_t)
        lp, lse = prim.token_logps(z, tc, ignore_index)
        lp = lp.view(nr, t)  # (not view(-1, t): ambiguous for T = 0)
        at = 0
        for s in rows:
            k = s.stop - s.start
            logps[s] = lp[at : at + k]
            at += k
        if contrib is None:
            continue
        args = [None if a is None else _take(a, rows) for a in aux]
        with torch.enable_grad():  # in float64: tiny [r, T], and a saturated sigmoid's slope keeps its digits
            x = lp.detach().to(torch.float64).requires_grad_(grads)
            part = contrib(x, *args).sum()
        loss += part.detach()
        if not grads:
            continue
        (d,) = torch.autograd.grad(part, x, allow_unused=True, materialize_grads=True)
        dz = z if z.dtype == hidden.dtype else torch.empty(z.shape, dtype=hidden.dtype, device=dev)
        prim.token_grad_(z, tc, lse, (d.reshape(-1) * -inv_t).to(acc).contiguous(), dz, ignore_index)
        del z
        if gh is not None:
            g = torch.mm(dz, weight).view(nr, t, h)
            at = 0
            for s in rows:
                k = s.stop - s.start
                gh[s] = g[at : at + k]
                at += k
        if gw is not None:
            gw.addmm_(dz.t(), hc)
        if gb is not None:
            gb += dz.sum(0, dtype=acc)
    return loss, logps, gh, gw, None if gb is None else gb.to(bias.dtype)


def logps_only(
    prim: ModuleType,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    ignore_index: int,
    temperature: float = 1.0,
    budget: int | None = None,
) -> torch.Tensor:
    """Per-token log-probs ``[R, T]`` (0 where ignored) without gradients (a reference model's)."""
    with torch.no_grad():
        return walk(prim, hidden.detach(), weight.detach(), None if bias is None else bias.detach(), target, ignore_index,
                    temperature, False, None, budget=budget)[1]  # fmt: skip


class _Fused(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, prim, args, kwargs):  # type: ignore[override]
        needs = tuple(ctx.needs_input_grad[:3])
        loss, logps, gh, gw, gb = walk(prim, hidden, weight, bias, *args, needs=needs, **kwargs)
        ctx.grads, ctx.prim = (gh, gw, gb), prim
        ctx.mark_non_differentiable(logps)
        return loss, logps

    @staticmethod
    def backward(ctx, g, _):  # type: ignore[override]
        if ctx.grads is None:
            raise RuntimeError(
                "polykernel fused preference/RL loss: backward ran twice through the same graph; its gradients were "
                "computed in the forward and are consumed by the first backward (retain_graph is not supported)"
            )
        (gh, gw, gb), ctx.grads = ctx.grads, None
        if torch.is_grad_enabled():  # create_graph=True: these gradients carry no graph, a second order would be silently 0
            raise RuntimeError(
                "polykernel fused preference/RL loss: create_graph=True (double backward) is not supported; its gradients "
                "are computed in the forward without a graph"
            )
        ctx.prim.scale_grads_(g, gh, gw, gb)
        return gh, gw, gb, None, None, None


def run(
    prim: ModuleType,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    ignore_index: int,
    temperature: float,
    pairs: bool,
    contrib: Contrib,
    aux: Sequence[torch.Tensor | None] = (),
    budget: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, logps)``: the loss (differentiable in hidden, weight, bias) and the detached
    per-token log-probs ``[R, T]`` fp32 (0 where ignored), from validated arguments."""
    hidden = hidden if hidden.is_contiguous() else hidden.contiguous()
    args = (target, ignore_index, temperature, pairs, contrib, tuple(aux))
    kw = {"budget": budget}
    wants = any(x is not None and x.requires_grad for x in (hidden, weight, bias))
    if torch.is_grad_enabled() and wants:
        return _Fused.apply(hidden, weight, bias, prim, args, kw)
    loss, logps, *_ = walk(prim, hidden, weight, bias, *args, **kw)
    return loss, logps
