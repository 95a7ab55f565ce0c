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

with the head's classes padded to a multiple of 16 bytes for the matmuls (``core.aligned_head``).

No per-sequence statistic couples two chunks: a chunk holds whole pairs (both rows of a pair)
or whole sequences (GRPO's sequence-level importance ratio is a statistic of one sequence).
The forward stores the gradients for a unit cotangent; the backward scales them by it, so the
graph can be back-propagated once. Peak extra memory: one chunk's fp32 logits and its dlogits
(``CHUNK_BYTES``), besides the gradients.

One unit larger than ``CHUNK_BYTES`` (a pair of 1024-token rows at V = 128K: 1.05 GB of fp32
logits, 0.53 GB of bf16 dlogits), and a 16-bit unit alone in its chunk whose fp32 logits exceed
``SUB_BYTES`` (KTO's or GRPO's 1024-token sequence: 0.79 GB; ``ops._preference.keeps_g``),
takes its logits ``SUB_BYTES`` of tokens at a time and keeps
only ``G = softmax(z) − onehot(t)`` of every token, in the inputs' dtype (:func:`_unit_logps`);
the formula's slope ``s`` per token, known once the whole unit's log-probs are, then goes on
the ``[rows, H]`` operands, so ``dz = −s/temperature · G`` is never formed (:meth:`_Grads.push_kept`):
3 GEMMs as the one-pass walk, ``[rows, V]`` in the inputs' dtype plus one sub-chunk of fp32
logits (0.53 + 0.26 GB there), and one more rounding of each gradient (the error model counts it).
When a single unit is larger than ``UNIT_BYTES``, the walk takes token chunks in two passes
instead (log-probs first, then the formula on all of them, then the logits again for the
gradients: one more GEMM, memory within ``CHUNK_BYTES``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType

import torch

from .. import _compat
from ..core.aligned_head import aligned_head, own_rows
from ..core.cpu_gemm import mm
from ..ops import _autocast

# the chunking the losses' error models count on is theirs (CHUNK_BYTES, units_per_chunk)
from ..ops._preference import CHUNK_BYTES, SUB_BYTES, keeps_g, unit_bytes, units_per_chunk
from ..ops._preference_reference import whole_logits_logps
from ._fused_linear_jsd import projector

# One unit larger than CHUNK_BYTES still goes in one pass up to this size of fp32 logits and
# dlogits (a pair of 1024-token rows at V = 128K in bf16 is 1.5 GiB: one pass, 3 GEMMs, holding
# [rows, V] in bf16 and SUB_BYTES of fp32 logits), and the two-pass token walk past it (4 GEMMs,
# memory within CHUNK_BYTES).
UNIT_BYTES = 4 << 30

Contrib = Callable[..., torch.Tensor]
_transforms_active = _compat.functorch_transforms_active


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


def _logits(proj, hc: torch.Tensor, bias: torch.Tensor | None, inv_t: float, z: torch.Tensor | None = None) -> torch.Tensor:
    """``(hc @ W.T + b) / temperature``; ``z``: the GEMM's result already there (into a buffer)."""
    z = proj(hc) if z is None else z
    if bias is not None:
        z.add_(bias.to(z.dtype))
    if inv_t != 1.0:
        z.mul_(inv_t)
    return z


def token_rows(v: int, elt: int, budget: int) -> int:
    """Token rows per chunk of the two-pass walk: fp32 logits and dlogits within ``budget``, a
    multiple of 128 when large (matmul tiles), at least one."""
    rows = max(1, budget // (max(v, 1) * (4 + elt)))
    return rows - rows % 128 if rows >= 256 else rows


class _Grads:
    """The gradients being accumulated, and the push of one chunk's dlogits into them.
    ``weight``: the head padded to 16 bytes (``core.aligned_head``), ``v`` its classes before."""

    def __init__(self, hidden, weight, bias, needs, acc, v: int) -> None:
        r, t, h = hidden.shape
        dev = hidden.device
        self.h = torch.zeros((r, t, h), dtype=hidden.dtype, device=dev) if needs[0] else None
        self.w = torch.zeros((weight.shape[0], h), dtype=weight.dtype, device=dev) if needs[1] else None
        self.b = torch.zeros(v, dtype=acc, device=dev) if needs[2] and bias is not None else None
        self.weight, self.dtype, self.acc, self.bias_dtype = weight, hidden.dtype, acc, None if bias is None else bias.dtype
        self.v = v

    def push(self, prim, z, tc, lse, scale, hc, ignore_index) -> torch.Tensor | None:
        """``dz = scale · (softmax − onehot)`` over the chunk's logits ``z [r, Vp]`` (overwritten;
        0 past V), then ``dW += dzᵀ hc``, ``db += Σ dz``; returns ``dz @ W`` (the chunk's rows of
        dH) if wanted."""
        v = self.v
        dz = z if z.dtype == self.dtype else torch.empty(z.shape, dtype=self.dtype, device=z.device)
        prim.token_grad_(z[:, :v], tc, lse, scale, dz[:, :v], ignore_index)
        del z
        if dz.shape[1] != v:
            dz[:, v:].zero_()  # (a non-finite hidden row gave NaN logits there: inf * 0)
        if self.w is not None:
            self.w.addmm_(dz.t(), hc)
        if self.b is not None:
            self.b += dz[:, :v].sum(0, dtype=self.acc)
        return None if self.h is None else mm(dz, self.weight)

    def push_kept(self, g, scale, hc) -> torch.Tensor | None:
        """The same for a unit whose ``G = softmax − onehot`` was kept (:func:`_unit_logps`):
        ``dz = scale ⊙ G`` by rows is never formed, the scale goes on the ``[r, H]`` operands
        (``dW += Gᵀ (scale ⊙ hc)``, ``db += Gᵀ scale``, ``dH = scale ⊙ (G @ W)``), so G is used as
        stored and no second ``[r, V]`` buffer is made."""
        s = scale[:, None]
        if self.w is not None:
            self.w.addmm_(g.t(), (hc * s).to(hc.dtype))
        if self.b is not None:
            self.b += torch.mv(g[:, : self.v].t(), scale.to(g.dtype)).to(self.acc)
        return None if self.h is None else mm(g, self.weight).mul_(s)

    def result(self):
        return self.h, own_rows(self.w, self.v), None if self.b is None else self.b.to(self.bias_dtype)


def _unit_logps(prim, proj, weight, hc, tc, bias, inv_t, ignore_index, keep, v):
    """One unit over the chunk budget: its log-probs from ``SUB_BYTES`` of fp32 logits at a time
    and, with ``keep``, ``G = softmax − onehot`` of every token (0 where ignored, and past the
    ``v`` classes of the padded head ``weight``) in the inputs' dtype: the dlogits up to the
    per-token scale, which the formula gives only once it has seen the whole unit's log-probs.
    fp32 inputs compute each sub-chunk's logits in G's own rows."""
    n, vp = hc.shape[0], weight.shape[0]
    acc = torch.promote_types(hc.dtype, torch.float32)
    lp = torch.empty(n, dtype=acc, device=hc.device)
    g = torch.empty((n, vp), dtype=hc.dtype, device=hc.device) if keep else None
    step = token_rows(v, 0, SUB_BYTES)
    ones = torch.ones(min(step, n), dtype=acc, device=hc.device)  # token_grad_'s scale: G itself
    for s in range(0, n, step):
        e = min(n, s + step)
        into = torch.mm(hc[s:e], weight.t(), out=g[s:e]) if keep and g.dtype == acc else None
        z = _logits(proj, hc[s:e], bias, inv_t, into)
        lp[s:e], lse = prim.token_logps(z[:, :v], tc[s:e], ignore_index)
        if keep:
            prim.token_grad_(z[:, :v], tc[s:e], lse, ones[: e - s], (z if into is not None else g[s:e])[:, :v], ignore_index)
            if vp != v:
                g[s:e, v:].zero_()
        del z
    return lp, g


def _slope(contrib, lp, args, grads):
    """``(sum of contrib's terms, ∂ sum / ∂ lp or None)``, in float64: the formula runs on a tiny
    ``[r, T]``, and a saturated sigmoid's slope keeps its digits."""
    with torch.enable_grad():
        x = lp.detach().to(torch.float64).requires_grad_(grads)
        part = contrib(x, *args).sum()
    if not grads:
        return part.detach(), None
    (d,) = torch.autograd.grad(part, x, allow_unused=True, materialize_grads=True)
    return part.detach(), d


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
    that ``contrib`` takes after the chunk's log-probs, sliced like them.

    Whole units per chunk when one unit's logits fit ``budget`` (one pass); one unit per chunk
    in sub-chunks of logits, its G kept, up to ``UNIT_BYTES`` (still one pass); past it token
    chunks in two passes (:func:`_walk_tokens`)."""
    r, t, h = hidden.shape
    v = weight.shape[0]
    target = target.long()  # (gather and scatter take int64 indices)
    budget = CHUNK_BYTES if budget is None else budget  # read per call: tests shrink it
    units, rows_per_unit = (r // 2, 2) if pairs else (r, 1)
    elt = hidden.element_size()
    per_unit = unit_bytes(rows_per_unit, t, v, elt)
    if per_unit > max(budget, UNIT_BYTES) and r:
        return _walk_tokens(prim, hidden, weight, bias, target, ignore_index, temperature, contrib, aux, needs, budget)
    dev = hidden.device
    acc = torch.promote_types(hidden.dtype, torch.float32)
    logps = torch.zeros((r, t), dtype=acc, device=dev)
    loss = torch.zeros((), dtype=acc, device=dev)
    grads = contrib is not None and any(needs)
    # the matmuls run over the head padded to 16 bytes (core.aligned_head): zero rows, whose logits
    # are zero and whose dlogits are cleared (_Grads.push, _unit_logps), so they add exact zeros
    weight_k, bias_k = aligned_head(weight, bias, elt)
    acc_grads = _Grads(hidden, weight_k, bias, needs if grads else (False, False, False), acc, v)
    proj = projector(weight_k)
    inv_t = 1.0 / temperature
    step = units_per_chunk(units, rows_per_unit, t, v, elt, budget)
    # one unit per chunk, over the budget (or 16-bit, its fp32 logits over SUB_BYTES): its logits in sub-chunks, G kept
    kept = keeps_g(units, rows_per_unit, t, v, elt, budget, SUB_BYTES)
    for rows in _chunks(r, pairs, step):
        nr = sum(s.stop - s.start for s in rows)
        hc = _take(hidden, rows).reshape(-1, h)
        tc = _take(target, rows).reshape(-1).contiguous()  # the kernel reads ids at unit stride
        if kept:  # z: the unit's G (None without gradients), not its logits
            lp, z = _unit_logps(prim, proj, weight_k, hc, tc, bias_k, inv_t, ignore_index, grads, v)
        else:
            z = _logits(proj, hc, bias_k, inv_t)
            lp, lse = prim.token_logps(z[:, :v], tc, ignore_index)
        lp = lp.view(nr, t)  # (not view(-1, t): ambiguous for T = 0)
        at = 0
        for s in rows:
            k = s.stop - s.start
            logps[s] = lp[at : at + k]
            at += k
        if contrib is None:
            continue
        part, d = _slope(contrib, lp, [None if a is None else _take(a, rows) for a in aux], grads)
        loss += part
        if d is None:
            continue
        scale = (d.reshape(-1) * -inv_t).to(acc).contiguous()
        if kept:  # where, not a product: an ignored token's G row is 0 but its scale may be inf or NaN
            g = acc_grads.push_kept(z, torch.where(tc != ignore_index, scale, 0.0), hc)
        else:
            g = acc_grads.push(prim, z, tc, lse, scale, hc, ignore_index)
        del z
        if g is not None:
            g = g.view(nr, t, h)
            at = 0
            for s in rows:
                k = s.stop - s.start
                acc_grads.h[s] = g[at : at + k]
                at += k
    return (loss, logps, *acc_grads.result())


def _walk_tokens(prim, hidden, weight, bias, target, ignore_index, temperature, contrib, aux, needs, budget):
    """The walk when one unit (a pair, a sequence) is too long for ``budget``: pass 1 takes token
    chunks to the log-probs and LSEs of every token, the formula then runs once on the whole
    ``[R, T]`` log-probs, pass 2 recomputes each chunk's logits and pushes its gradient (one
    more logits GEMM than the one-pass walk; memory stays within ``budget``)."""
    r, t, h = hidden.shape
    n, v, dev = r * t, weight.shape[0], hidden.device
    acc = torch.promote_types(hidden.dtype, torch.float32)
    h2, t2 = hidden.reshape(n, h), target.reshape(n).contiguous()
    weight_k, bias_k = aligned_head(weight, bias, hidden.element_size())  # (as walk's)
    proj = projector(weight_k)
    inv_t = 1.0 / temperature
    step = token_rows(v, hidden.element_size(), budget)
    lp_all = torch.empty(n, dtype=acc, device=dev)
    lse_all = torch.empty(n, dtype=acc, device=dev)
    for s in range(0, n, step):
        lp, lse = prim.token_logps(_logits(proj, h2[s : s + step], bias_k, inv_t)[:, :v], t2[s : s + step], ignore_index)
        lp_all[s : s + step], lse_all[s : s + step] = lp, lse
    logps = lp_all.view(r, t)
    grads = contrib is not None and any(needs)
    acc_grads = _Grads(hidden, weight_k, bias, needs if grads else (False, False, False), acc, v)
    if contrib is None:
        return (torch.zeros((), dtype=acc, device=dev), logps, *acc_grads.result())
    part, d = _slope(contrib, logps, list(aux), grads)
    if d is not None:
        scale = (d.reshape(-1) * -inv_t).to(acc).contiguous()
        for s in range(0, n, step):
            hc = h2[s : s + step]
            z = _logits(proj, hc, bias_k, inv_t)
            g = acc_grads.push(prim, z, t2[s : s + step], lse_all[s : s + step], scale[s : s + step], hc, ignore_index)
            del z
            if g is not None:
                acc_grads.h.view(n, h)[s : s + step] = g
    return (part.to(acc), logps, *acc_grads.result())


def _plain_logps(hidden, weight, bias, target, ignore_index: int, temperature: float) -> torch.Tensor:
    """``[R, T]`` log-probs (0 where ignored) from the whole ``[R, T, V]`` logits in the
    accumulation dtype, in plain ops: the path under functorch transforms."""
    acc = torch.promote_types(hidden.dtype, torch.float32)
    return whole_logits_logps(hidden, weight, bias, target, ignore_index, temperature, acc)


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
    if _transforms_active():
        with torch.no_grad():
            return _plain_logps(hidden, weight, bias, target, ignore_index, temperature)
    if _autocast.enabled(hidden.device.type):  # the head as F.linear there (ops._autocast)
        hidden, weight, bias = _autocast.as_linear(hidden.device.type, hidden, weight, bias)
        with _autocast.off(hidden.device.type):
            return logps_only(prim, hidden, weight, bias, target, ignore_index, temperature, budget)  # type: ignore[arg-type]
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
        if torch.is_grad_enabled():  # create_graph=True: these gradients carry no graph, a second order would be silently 0
            raise RuntimeError(
                "polykernel fused preference/RL loss: create_graph=True (double backward) is not supported; its gradients "
                "are computed in the forward without a graph"
            )
        if ctx.grads is None:
            raise RuntimeError(
                "polykernel fused preference/RL loss: backward ran twice through the same graph; its gradients were "
                "computed in the forward and are consumed by the first backward (retain_graph is not supported)"
            )
        (gh, gw, gb), ctx.grads = ctx.grads, None
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
    if _transforms_active():  # functorch (grad, vmap, jvp): plain torch ops, which its transforms take
        lp = _plain_logps(hidden, weight, bias, target, ignore_index, temperature)
        loss = contrib(lp.to(torch.float64), *aux).sum().to(lp.dtype)  # the formula in float64, as the walk's
        return loss, lp.detach()
    if _autocast.enabled(hidden.device.type):  # the head as F.linear there (ops._autocast)
        hidden, weight, bias = _autocast.as_linear(hidden.device.type, hidden, weight, bias)
        with _autocast.off(hidden.device.type):
            return run(prim, hidden, weight, bias, target, ignore_index, temperature, pairs, contrib, aux, budget)  # type: ignore[arg-type]
    hidden = hidden if hidden.is_contiguous() else hidden.contiguous()
    args = (target, ignore_index, temperature, pairs, contrib, tuple(aux))
    kw = {"budget": budget}
    wants = any(x is not None and x.requires_grad for x in (hidden, weight, bias))
    if torch.is_grad_enabled() and wants:
        return _Fused.apply(hidden, weight, bias, prim, args, kw)
    loss, logps, *_ = walk(prim, hidden, weight, bias, *args, **kw)
    return loss, logps


@dataclass(frozen=True)
class Head:
    """The chunked linear + log-prob machinery with one per-token primitive (torch or Triton):
    what an impl hands a loss's ``chunked`` (``polykernel.ops._preference.Head``)."""

    prim: ModuleType

    def run(self, hidden, weight, bias, target, ignore_index, temperature, pairs, contrib, aux=()) -> tuple[torch.Tensor, torch.Tensor]:
        return run(self.prim, hidden, weight, bias, target, ignore_index, temperature, pairs, contrib, aux)

    def logps_only(self, hidden, weight, bias, target, ignore_index) -> torch.Tensor:
        return logps_only(self.prim, hidden, weight, bias, target, ignore_index)
