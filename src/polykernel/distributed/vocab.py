"""Vocab-parallel cross-entropy: the losses on logits (or an LM head) sharded over the vocabulary.

A column-parallel LM head (``ColwiseParallel``: weight ``Shard(0)``) leaves each rank a slice of
the vocabulary. The loss needs each row's log-sum-exp over the whole vocabulary, but not the
``[N, V]`` logits: per row, each rank computes on its slice

    lse_r = log Σ exp(z),  z_t (the target's logit where the rank owns the target, else 0),
    Σ w·z (the class-weighted sum of logits, only with label smoothing)

and ONE ``all_gather`` of that ``[N, 3]`` table gives every rank the global ``lse = logsumexp_r lse_r``
(the log-sum-exp trick: exact, no overflow, no second collective), the target logit and the sums.
Every rank then holds the same loss (``Replicate()``). The backward is local: the gradient of a
rank's logits is ``c·(p - (1-ε)·w_t·onehot - ε/V·w)`` on its own slice, ``p = exp(z - lse)``.

- ``loss.cross_entropy`` on logits ``Shard(-1)`` (a 1-D mesh): one all_gather per call; the
  logits' gradient comes back ``Shard(-1)``.
- ``loss.fused_linear_cross_entropy`` on a weight (and bias) ``Shard(0)`` with hidden replicated:
  row chunks as on one device (the logits of one chunk at a time), one all_gather per chunk (the
  gradients are made in the forward, from the global lse). The hidden states' gradient is each
  rank's partial ``dz_local @ W_local``: it is handed back ``Partial()``, so DTensor sums it over
  the ranks (an all-reduce, or the reduce-scatter of a sequence-parallel input): the
  column-parallel backward. The weight's and bias's gradients are ``Shard(0)``.

The collective runs inside the loss: every rank of the mesh must call it, with the same shapes.
The first call of each shape signature checks that with one tiny ``all_gather`` of the shapes and
raises ``OpArgumentError`` naming the op and the argument when ranks differ (later calls with a
shape already checked skip the check, so a mismatch that first appears then is not caught).

The options are pure math on the local slices: ``label_smoothing`` (the Σ w·z statistic),
``ignore_index``, ``reduction``; and, for the options being added to the single-device ops,
``softcap`` (elementwise ``cap·tanh(z/cap)`` before the lse), ``z_loss`` (``z·w[t]·lse²`` per
scored row, from the global lse) and class weights (``weight``; the fused loss's ``ce_weight``:
``w[t]`` is known from the replicated target; the mean divides by ``Σ w[t]`` as PyTorch does), with
the semantics of the single-device ops' reference. A call with an option this module does not know
takes the gather path instead (:func:`vocab_plan` returns None).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..core.aligned_head import aligned_head, own_rows
from ..core.cpu_gemm import mm
from ..errors import OpArgumentError, OpTypeError
from .vocab_math import (  # the math on one rank's slice; loss_stats is public here
    N_STATS,
    Options,
    _all_gather,
    _capped,
    divisor,
    grad_logits,
    local_stats,
    loss_stats,
    reduce,
    row_losses,
)

__all__ = ["VocabPlan", "loss_stats", "run", "vocab_plan"]

CHUNK_BYTES = 128 << 20  # FLCE: logits of one row chunk (its fp32 copy and dz: 2 x 2x that at bf16)
TEMP_BYTES = 64 << 20  # fp32 temporaries of one row chunk of given logits

# Arguments the vocab-parallel path understands, per op (the reference's names) with the values
# that mean "off"; a call with any other argument set takes the gather path.
_KNOWN = {
    "loss.cross_entropy": {"logits", "target", "ignore_index", "label_smoothing", "reduction", "softcap", "z_loss", "weight"},
    "loss.fused_linear_cross_entropy": {
        "hidden", "weight", "target", "bias", "ignore_index", "label_smoothing", "reduction", "softcap", "z_loss", "ce_weight",
    },
}  # fmt: skip
_OFF = (None, 0, 0.0, False)


@dataclass
class VocabPlan:
    """A vocab-parallel call: which op, the mesh, the text ``explain`` prints, and the
    arguments by name."""

    kind: str  # "logits" or "weight"
    mesh: Any
    text: str
    args: dict[str, Any]
    moved: list[str]


# -- autograd around the local computation ---------------------------------------------------------


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _coef(g: torch.Tensor, reduction: str, den: torch.Tensor, rows: int, acc: torch.dtype) -> torch.Tensor:
    """Per-row upstream coefficient of the loss's cotangent ``g``."""
    g = g.to(acc)
    if reduction == "none":
        return g.reshape(-1)
    if reduction == "mean":  # nothing scored: zero gradients (the loss is NaN), as the reference
        scored = den[1] > 0
        g = torch.where(scored, g / torch.where(scored, den[0], 1.0), 0.0)
    return g.expand(rows)


class _VocabCE(torch.autograd.Function):
    """Cross-entropy of local logits ``[N, V_local]`` (columns ``lo:``) against replicated targets."""

    @staticmethod
    def forward(ctx, x, t, cw, lo, v, o, group):  # type: ignore[override]
        acc = _acc(x.dtype)
        n, vl = x.shape
        step = max(1, TEMP_BYTES // max(1, vl * 4))
        w_local = None if cw is None else cw[lo : lo + vl]
        stats = torch.cat(
            [local_stats(_capped(x[s : s + step].to(acc), o.softcap), t[s : s + step], lo, w_local, bool(o.label_smoothing))
             for s in range(0, n, step)] or [torch.zeros(0, N_STATS, dtype=acc, device=x.device)]
        )  # fmt: skip
        lse, zt, sz = loss_stats(group, stats)
        losses = row_losses(lse, zt, sz, t, o, v, cw)
        den = divisor(t, o, v, cw, acc)
        ctx.save_for_backward(x, t, lse, den, cw)
        ctx.args = (lo, v, o, step, acc)
        return reduce(losses, den, o.reduction, (n,))

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        x, t, lse, den, cw = ctx.saved_tensors
        lo, v, o, step, acc = ctx.args
        n = x.shape[0]
        coef = _coef(g, o.reduction, den, n, acc)
        dx = torch.empty_like(x)
        for s in range(0, n, step):
            e = min(n, s + step)
            xs = x[s:e]  # upcast: a fresh buffer to work in; fp32 logits are the caller's (not written)
            dx[s:e] = grad_logits(xs.to(acc), lse[s:e], t[s:e], lo, coef[s:e], o, v, cw, inplace=xs.dtype != acc)
        return dx, None, None, None, None, None, None


def _chunk_rows(vl: int, elt: int) -> int:
    rows = max(1, CHUNK_BYTES // (max(vl, 1) * elt))
    return rows - rows % 128 if rows >= 256 else rows


class _VocabFLCE(torch.autograd.Function):
    """Fused linear cross-entropy of replicated ``h [N, H]`` with a weight slice ``[V_local, H]``."""

    @staticmethod
    def forward(ctx, h, w, b, t, cw, lo, v, o, group):  # type: ignore[override]
        acc = _acc(h.dtype)
        n = h.shape[0]
        vl = w.shape[0]
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], b is not None and ctx.needs_input_grad[2])
        grads_now = o.reduction != "none" and any(needs)
        den = divisor(t, o, v, cw, acc)
        # "sum"/"mean": the gradients are made here, per chunk, for a cotangent of 1 (scaled in
        # the backward); "none": the backward recomputes the logits with the saved lse
        coef = _coef(torch.ones((), device=h.device), o.reduction, den, n, acc) if grads_now else None
        # the matmuls run over the slice padded to 16-byte multiples, as on one device (core.aligned_head)
        wk, bk = aligned_head(w, b, h.element_size())
        gh = torch.zeros_like(h) if grads_now and needs[0] else None
        gw = torch.zeros((wk.shape[0], w.shape[1]), dtype=w.dtype, device=w.device) if grads_now and needs[1] else None
        gb = torch.zeros(vl, dtype=acc, device=w.device) if grads_now and needs[2] else None
        losses = torch.empty(n, dtype=acc, device=h.device)
        lses = torch.empty(n, dtype=acc, device=h.device)
        w_local = None if cw is None else cw[lo : lo + vl]
        step = _chunk_rows(vl, h.element_size())
        for s in range(0, n, step):
            e = min(n, s + step)
            full, x = _logits(h[s:e], wk, bk, vl, acc)
            lse, zt, sz = loss_stats(group, local_stats(_capped(x, o.softcap), t[s:e], lo, w_local, bool(o.label_smoothing)))
            losses[s:e], lses[s:e] = row_losses(lse, zt, sz, t[s:e], o, v, cw), lse
            if coef is not None:
                dz = grad_logits(x, lse, t[s:e], lo, coef[s:e], o, v, cw, inplace=True)
                _accumulate(dz, full, h, wk, s, e, gh, gw, gb)
        gw = own_rows(gw, vl)  # not a view: a tied head's two gradients are summed in place (core.aligned_head)
        ctx.grads = (gh, gw, gb) if grads_now else None
        ctx.save_for_backward(h, w, b, t, lses, den, cw)
        ctx.args = (lo, v, o, needs, acc, step)
        return reduce(losses, den, o.reduction, (n,))

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        h, w, b, t, lses, den, cw = ctx.saved_tensors
        lo, v, o, needs, acc, step = ctx.args
        if ctx.grads is not None:
            (gh, gw, gb), ctx.grads = ctx.grads, None
            g = g.to(acc)
            gh = None if gh is None else gh.mul_(g)  # in place: no second [N, H] / [V_local, H] buffer
            gw = None if gw is None else gw.mul_(g)
            gb = None if gb is None else (gb * g).to(b.dtype)
        else:
            n, vl = h.shape[0], w.shape[0]
            coef = _coef(g, o.reduction, den, n, acc)
            wk, bk = aligned_head(w, b, h.element_size())
            gh = torch.zeros_like(h) if needs[0] else None
            gw = torch.zeros((wk.shape[0], w.shape[1]), dtype=w.dtype, device=w.device) if needs[1] else None
            gb = torch.zeros(vl, dtype=acc, device=w.device) if needs[2] else None
            for s in range(0, n, step):
                e = min(n, s + step)
                full, x = _logits(h[s:e], wk, bk, vl, acc)
                dz = grad_logits(x, lses[s:e], t[s:e], lo, coef[s:e], o, v, cw, inplace=True)
                _accumulate(dz, full, h, wk, s, e, gh, gw, gb)
            gw = own_rows(gw, vl)
            gb = None if gb is None else gb.to(b.dtype)
        return gh, gw, gb, None, None, None, None, None, None


def _logits(hc: torch.Tensor, wk: torch.Tensor, bk: torch.Tensor | None, vl: int, acc: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's logits over the padded slice ``wk`` (``full``, ``[rows, Vp]`` in the inputs'
    dtype) and its first ``vl`` columns in ``acc`` (a view of ``full`` where the dtypes agree)."""
    full = torch.nn.functional.linear(hc, wk, bk)
    return full, (full if full.shape[1] == vl else full[:, :vl]).to(acc)


def _accumulate(dz: torch.Tensor, full: torch.Tensor, h: torch.Tensor, wk: torch.Tensor, s: int, e: int, gh: Any, gw: Any, gb: Any) -> None:
    """A chunk's ``dz [rows, V_local]`` into the partial grad_hidden, grad_weight (``[Vp, H]``) and
    grad_bias: matmuls in the inputs' dtype (fp32 accumulation inside) over the padded slice, ``dz``
    written into the chunk's ``full`` logits (its columns past V_local zeroed: zero rows of ``wk``,
    they add exact zeros; a non-finite hidden row would leave NaN there), grad_weight accumulated in
    the weight's dtype over the chunks as the single-device op does (no fp32 [V_local, H] copy)."""
    vl = dz.shape[1]
    if full.shape[1] == vl:
        d = dz.to(h.dtype)
    else:
        d = full
        if gh is not None or gw is not None:
            if dz.data_ptr() != full.data_ptr():  # (fp32 inputs: dz is full's own first columns already)
                full[:, :vl].copy_(dz)
            full[:, vl:].zero_()
    if gh is not None:
        mm(d, wk, out=gh[s:e])
    if gw is not None:
        gw.addmm_(d.t(), h[s:e])
    if gb is not None:
        gb += dz.sum(0)


# -- routing: when a call is vocab-parallel, and running it ------------------------------------------


def _placement(p: Any) -> str:
    return f"Shard({p.dim})" if p.is_shard() else "Replicate()" if p.is_replicate() else "Partial()"


def _is_dtensor(a: Any) -> bool:
    return isinstance(a, DTensor)


def vocab_plan(op_id: str, kind: str, names: Sequence[str], args: Sequence[Any]) -> VocabPlan | None:
    """The vocab-parallel plan for a call (``args`` positional, named by ``names``), or None when
    the call is not vocab-sharded on a 1-D mesh or sets an option this path does not know (then
    the ordinary route gathers the vocabulary first)."""
    a = dict(zip(names, args))
    known = _KNOWN.get(op_id, set())
    if any(k not in known and v not in _OFF for k, v in a.items() if not isinstance(v, torch.Tensor)):
        return None
    if any(k not in known for k, v in a.items() if isinstance(v, torch.Tensor)):
        return None
    lead = a["logits"] if kind == "logits" else a["weight"]
    if not _is_dtensor(lead) or lead.device_mesh.ndim != 1 or lead.dim() < 1:
        return None
    p = lead.placements[0]
    want = lead.dim() - 1 if kind == "logits" else 0
    if not (p.is_shard() and p.dim % lead.dim() == want) or (kind == "weight" and lead.dim() != 2):
        return None
    mesh = lead.device_mesh
    for k, x in a.items():  # as the row route: DTensors for all tensor arguments, on one mesh
        if isinstance(x, torch.Tensor) and not _is_dtensor(x):
            raise OpTypeError(op_id, k, "is a plain tensor while other arguments are DTensors: pass DTensors for all, or none")
        if isinstance(x, torch.Tensor) and x.device_mesh != mesh:
            raise OpTypeError(op_id, k, f"is on another device mesh than {kind}")
    moved = []
    replicated = ("target",) if kind == "logits" else ("hidden", "target")
    for name in replicated:
        x = a.get(name)
        if _is_dtensor(x) and not x.placements[0].is_replicate():
            moved.append(f"{name} {_placement(x.placements[0])} -> Replicate()")
    b = a.get("bias")
    if kind == "weight" and _is_dtensor(b) and not b.placements[0].is_shard():
        moved.append(f"bias {_placement(b.placements[0])} -> Shard(0)")
    text = f"DTensor {'logits' if kind == 'logits' else 'weight'} {_placement(p)} on mesh of {mesh.size(0)}"
    return VocabPlan(kind, mesh, text, a, moved)


def explain_text(vp: VocabPlan) -> str:
    """The route ``explain`` prints for a vocab-parallel call."""
    moved = f"redistributed ({'; '.join(vp.moved)}), then " if vp.moved else ""
    what = "per call" if vp.kind == "logits" else "per row chunk"
    grads = "logits' gradient Shard(-1)" if vp.kind == "logits" else (
        "hidden's gradient Partial() (summed over the ranks by DTensor: the column-parallel backward), weight's and bias's Shard(0)"
    )  # fmt: skip
    return (
        f"{vp.text}: {moved}vocab-parallel (torch on the local vocabulary slices); holds a collective: one all_gather "
        f"of [N, {N_STATS}] statistics {what}, never [N, V]; every rank must call it with the same shapes; backward "
        f"local ({grads})"
    )


def _slice(v: int, world: int, rank: int) -> tuple[int, int]:
    """DTensor's Shard: ``torch.chunk`` sizes (ceil(V / world), the last ranks shorter or empty)."""
    size = -(-v // world)
    lo = min(rank * size, v)
    return lo, min(v, lo + size) - lo


_checked: set[tuple[Any, ...]] = set()


def check_shapes(op_id: str, group: Any, name: str, sig: tuple[int, ...], device: torch.device) -> None:
    """All ranks call with the same shapes (else the statistics' collective would mismatch):
    one all_gather of the shapes on the first call of each signature."""
    key = (op_id, id(group), sig)
    if key in _checked:
        return
    mine = torch.tensor(sig, dtype=torch.int64, device=device)
    rows = [tuple(r) for r in _all_gather(mine, group).tolist()]
    if any(r != rows[0] for r in rows):
        raise OpArgumentError(
            op_id,
            name,
            f"the vocab-parallel loss holds a collective: every rank must call it with the same shapes, got {rows} per rank",
        )
    _checked.add(key)


def _to(x: Any, mesh: Any, placements: list[Any]) -> Any:
    if not _is_dtensor(x):
        return x
    return x if tuple(x.placements) == tuple(placements) else x.redistribute(mesh, placements)


def _full(x: Any) -> Any:
    return x.full_tensor() if _is_dtensor(x) else x


def _waited(t: Any) -> Any:
    from .. import _compat

    return t.wait() if _compat.is_async_collective(t) else t


def run(op_id: str, vp: VocabPlan) -> Any:
    """Run a vocab-parallel call; the loss is a ``Replicate()`` DTensor (``"none"``: shaped like
    the target)."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    a, mesh = vp.args, vp.mesh
    group = mesh.get_group(0)
    rank, world = mesh.get_local_rank(0), mesh.size(0)
    o = Options(
        ignore_index=a["ignore_index"],
        label_smoothing=float(a.get("label_smoothing") or 0.0),
        reduction=a["reduction"],
        softcap=a.get("softcap") or None,
        z_loss=float(a.get("z_loss") or 0.0),
    )
    target = _to(a["target"], mesh, [Replicate()])
    t_shape = tuple(target.shape)
    t = _waited(target.to_local() if _is_dtensor(target) else target).reshape(-1).long()
    cw = _full(a.get("weight" if vp.kind == "logits" else "ce_weight"))
    if vp.kind == "logits":
        logits = a["logits"]
        v = logits.shape[-1]
        lo, vl = _slice(v, world, rank)
        x = _waited(logits.to_local())
        if x.shape[-1] != vl:
            raise OpArgumentError(op_id, "logits", f"expected the local vocabulary slice of {vl} classes (torch.chunk), got {x.shape[-1]}")
        check_shapes(op_id, group, "logits", (*logits.shape, *t_shape), x.device)
        x2 = x.reshape(math.prod(x.shape[:-1]), vl)  # (not -1: an empty slice has vl = 0)
        out = _VocabCE.apply(x2, t, cw, lo, v, o, group)
    else:
        weight, bias = a["weight"], a.get("bias")
        hidden = _to(a["hidden"], mesh, [Replicate()])
        v, hsize = weight.shape
        lo, vl = _slice(v, world, rank)
        w = _waited(weight.to_local())
        if w.shape[0] != vl:
            raise OpArgumentError(op_id, "weight", f"expected the local vocabulary slice of {vl} rows (torch.chunk), got {w.shape[0]}")
        check_shapes(op_id, group, "hidden", (*hidden.shape, v, hsize, *t_shape), w.device)
        h = hidden.to_local(grad_placements=[Partial()]) if _is_dtensor(hidden) else hidden
        h = _waited(h)
        h2 = h.reshape(math.prod(h.shape[:-1]), hsize)
        b = None
        if bias is not None:
            b = _waited(_to(bias, mesh, [Shard(0)]).to_local()) if _is_dtensor(bias) else bias[lo : lo + vl]
        out = _VocabFLCE.apply(h2, w, b, t, cw, lo, v, o, group)
    shape = t_shape if o.reduction == "none" else ()
    out = out.reshape(shape)
    return DTensor.from_local(out, mesh, [Replicate()], run_check=False, shape=shape, stride=_stride(shape))


def _stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(tuple(shape)):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))
