"""Fused linear cross-entropy's chunked driver, shared by every backend's impl of the op (issue 36:
here, not in ``backends/torch``, so that no backend imports another): logits never held for all rows at once.

``run`` is the chunked driver shared by every impl of the op; an impl passes its per-chunk
cross-entropy (``chunk_fn``), which turns a chunk's logits into per-row losses and, when asked,
overwrites them with the scaled dlogits. Per chunk of ``chunk_rows`` rows:

    logits = hidden[c] @ weight.T + bias          (torch matmul, hidden's dtype, a fresh buffer)
    loss[c] = chunk_fn(logits, ...)               (logits -> dlogits in place)
    grad_hidden[c] = dlogits @ weight;  grad_weight += dlogits.T @ hidden[c];  grad_bias += Σ dlogits

with the head's classes padded to a multiple of 16 bytes for the matmuls (``core.aligned_head``).

Peak extra memory: one chunk of logits (``CHUNK_BYTES``) plus the chunk_fn's temporaries (this
impl: ``TEMP_BYTES`` fp32 rows at a time), besides the gradients themselves.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .. import _compat
from ..core.aligned_head import aligned_head, own_rows
from ..core.cpu_gemm import mm
from ..ops import _autocast
from ..ops.fused_linear_cross_entropy import OP_ID
from ..spec import Split
from . import _cross_entropy as _ce
from ._cross_entropy import NO_EXTRAS, Extras, denominator, extras, grad_scale, reduce_rows, scale_grads_
from ._double_backward import anchor, refuse

_transforms_active = _compat.functorch_transforms_active

# Logits of one row chunk, in the logits' dtype (~1024 rows at V = 128K bf16). Measured in training
# steps: smaller budgets cost tokens/s for tens of MiB of peak, larger gain ~1% for more
# (benchmarks/results/h100-2026-12-07-twentysixth/flce-training/).
CHUNK_BYTES = 256 << 20

ChunkFn = Callable[[torch.Tensor, torch.Tensor, int, float, "torch.Tensor | None", Extras], torch.Tensor]


def chunk_rows(v: int, elt: int) -> int:
    """Rows per chunk: logits within CHUNK_BYTES, a multiple of 128 when large (matmul tiles)."""
    rows = max(1, CHUNK_BYTES // (max(v, 1) * elt))
    return rows - rows % 128 if rows >= 256 else rows


def _rows(hidden: torch.Tensor) -> torch.Tensor:
    """hidden as [N, H] (not ``reshape(-1, H)``: ambiguous for H = 0, where the logits are the bias)."""
    return hidden.reshape(math.prod(hidden.shape[:-1]), hidden.shape[-1])


def _walk(
    h2: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    t: torch.Tensor,
    ignore_index: int,
    ls: float,
    chunk_fn: ChunkFn,
    scale: torch.Tensor | None,
    needs: tuple[bool, bool, bool] = (False, False, False),
    ex: Extras = NO_EXTRAS,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """One walk over the row chunks: losses, and with ``scale`` the scaled gradients
    (hidden, weight, bias) that ``needs`` asks for (``ex``: the cross-entropy options)."""
    n, h = h2.shape
    v = weight.shape[0]
    acc = torch.promote_types(h2.dtype, torch.float32)
    dev = h2.device
    losses = torch.empty(n, dtype=acc, device=dev)
    grads = scale is not None
    # the matmuls run over the head padded to 16-byte multiples (core.aligned_head): zero rows, whose
    # logits are zero and whose dlogits are cleared below, so they add exact zeros
    wk, bk = aligned_head(weight, bias, h2.element_size())
    vp = wk.shape[0]
    gh = torch.empty((n, h), dtype=h2.dtype, device=dev) if grads and needs[0] else None
    gw = torch.empty((vp, h), dtype=weight.dtype, device=dev) if grads and needs[1] else None
    gb = torch.zeros(v, dtype=acc, device=dev) if grads and needs[2] else None
    if gw is not None and n == 0:
        gw.zero_()
    step = chunk_rows(v, h2.element_size())  # (of V, as the op's error model counts the chunks of dW)
    for s in range(0, n, step):
        e = min(n, s + step)
        hc = h2[s:e]
        full = F.linear(hc, wk, bk)
        logits = full if vp == v else full[:, :v]
        sc = None if scale is None else scale if scale.dim() == 0 else scale[s:e]
        losses[s:e] = chunk_fn(logits, t[s:e], ignore_index, ls, sc, ex)
        if vp != v and (gh is not None or gw is not None):
            full[:, v:].zero_()  # a non-finite hidden row gives NaN there (inf * 0)
        if gh is not None:
            mm(full, wk, out=gh[s:e])
        if gw is not None:
            if s == 0:
                torch.mm(full.t(), hc, out=gw)
            else:
                gw.addmm_(full.t(), hc)
        if gb is not None:
            gb += logits.sum(0, dtype=acc)
        del logits, full
    return losses, gh, own_rows(gw, v), gb


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, bias, ignore_index, ls, reduction, chunk_fn, scale_fn, impl, ex):  # type: ignore[override]
        h2 = _rows(hidden)
        t = target.reshape(-1).long().contiguous()
        acc = torch.promote_types(hidden.dtype, torch.float32)
        count = denominator(t, ignore_index, ex.weight, acc)
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[3])
        ctx.args = (ignore_index, ls, chunk_fn, needs, acc, ex)
        ctx.scale_fn, ctx.impl = scale_fn, impl
        ctx.reduction, ctx.shape = reduction, hidden.shape
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.grads = None
        if reduction == "none":  # per-row grad_output: the backward recomputes the logits
            losses, *_ = _walk(h2, weight, bias, t, ignore_index, ls, chunk_fn, None, ex=ex)
            ctx.save_for_backward(h2, weight, bias, t, hidden)  # the inputs: refuse()'s anchors
        else:
            scale = grad_scale(torch.ones((), dtype=acc, device=h2.device), count, reduction, acc)
            losses, *grads = _walk(h2, weight, bias, t, ignore_index, ls, chunk_fn, scale, needs, ex)
            ctx.grads = grads
            with torch.enable_grad():  # handles on the inputs' graph, for refuse()
                ctx.save_for_backward(anchor(hidden), anchor(weight), anchor(bias))
        return reduce_rows(losses, count, reduction, target.shape)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        if torch.is_grad_enabled():  # create_graph=True: the gradients are made in buffers, without a graph
            with torch.no_grad():
                gh, gw, _, gb, *rest = _FusedLinearCrossEntropy.backward(ctx, g)
            why = "its gradients are computed chunk by chunk, in place; for higher derivatives use F.linear and polykernel.cross_entropy"
            saved = ctx.saved_tensors
            anchors = (saved[4], saved[1], saved[2]) if ctx.reduction == "none" else saved
            gh, gw, gb = refuse(OP_ID, ctx.impl, why, anchors, gh, gw, gb)
            return (gh, gw, None, gb, *rest)
        ignore_index, ls, chunk_fn, needs, acc, ex = ctx.args
        if ctx.reduction == "none":
            h2, weight, bias, t, _ = ctx.saved_tensors
            _, gh, gw, gb = _walk(h2, weight, bias, t, ignore_index, ls, chunk_fn, g.reshape(-1).to(acc), needs, ex)
        else:
            if ctx.grads is None:
                raise RuntimeError(
                    "polykernel fused_linear_cross_entropy: backward ran twice through the same graph; its gradients "
                    "were computed in the forward and are consumed by the first backward (retain_graph is not supported)"
                )
            (gh, gw, gb), ctx.grads = ctx.grads, None
            ctx.scale_fn(g, gh, gw, gb)
        return (
            None if gh is None else gh.view(ctx.shape),
            gw,
            None,
            None if gb is None else gb.to(ctx.bias_dtype),
            None,
            None,
            None,
            None,
            None,
            None,
            None,
        )


def differentiable(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    reduction: str,
    ex: Extras = NO_EXTRAS,
) -> torch.Tensor:
    """The op in differentiable torch ops (materializes the [N, V] logits): under functorch transforms."""
    return _ce.differentiable(F.linear(hidden, weight, bias), target, ignore_index, label_smoothing, reduction, *ex)


def run(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    reduction: str,
    chunk_fn: ChunkFn,
    scale_fn: Callable[..., None] = scale_grads_,
    impl: str = "torch",
    ex: Extras = NO_EXTRAS,
) -> torch.Tensor:
    """The op on validated arguments, with ``chunk_fn`` as the per-chunk cross-entropy and
    ``scale_fn(g, *grads)`` multiplying the forward's gradients by the cotangent in backward
    (``impl``: the calling impl's name, for error messages; ``ex``: the options)."""
    if _transforms_active():  # functorch (grad, vmap): plain torch ops, which its transforms take
        return differentiable(hidden, weight, target, bias, ignore_index, label_smoothing, reduction, ex)
    if _autocast.enabled(hidden.device.type):  # the head as F.linear there (ops._autocast)
        hidden, weight, bias = _autocast.as_linear(hidden.device.type, hidden, weight, bias)
        with _autocast.off(hidden.device.type):
            return run(hidden, weight, target, bias, ignore_index, label_smoothing, reduction, chunk_fn, scale_fn, impl, ex)
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (hidden, weight, bias)):
        args = (hidden, weight, target, bias, ignore_index, label_smoothing, reduction, chunk_fn, scale_fn, impl, ex)
        return _FusedLinearCrossEntropy.apply(*args)
    t = target.reshape(-1).long().contiguous()
    losses, *_ = _walk(_rows(hidden), weight, bias, t, ignore_index, label_smoothing, chunk_fn, None, ex=ex)
    return reduce_rows(losses, denominator(t, ignore_index, ex.weight, losses.dtype), reduction, target.shape)


# Forward and backward as separate functions, for compiled graphs (polykernel.compile.library). With
# reduction "mean"/"sum" the forward computes the gradients for grad_output = 1, as the eager
# path does, and saves them; the backward scales them. A compiled graph does that multiply itself,
# in the saved buffers (the op's saved_grads); this backward, out of place (a custom op's outputs
# are fresh tensors), runs only where that does not apply (DTensors). With "none" nothing is
# computed ahead and the backward walks the chunks again.
# This driver's split defines the op's saved layout (the op's saved), three fixed slots whatever
# grad_mask and reduction ask for, so that each slot has one placement under DTensor:
#   0: grad_hidden, shaped like hidden (sharded like its rows);
#   1: grad_weight [V, H] (a sum over the rows);
#   2: grad_bias [V], fp32 (a sum over the rows).
# A slot that is not computed holds an empty placeholder of the same rank and dtype, which the
# backward ignores: no allocation (numel 0), and valid under the slot's placements: grad_hidden's
# is hidden's shape with H = 0, so that it shards wherever hidden's rows do (DTensor refuses to
# shard a tensor dim smaller than the mesh, even as an input it only passes through); the sums'
# are (0, 0) and (0,), replicated or Partial.
def _needs(bias: torch.Tensor | None, grad_mask) -> tuple[bool, bool, bool]:
    return (bool(grad_mask[0]), bool(grad_mask[1]), bias is not None and bool(grad_mask[3]))


def _slots(hidden: torch.Tensor, weight: torch.Tensor) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
    """The saved slots' full shapes and dtypes: grad_hidden, grad_weight, grad_bias."""
    acc = torch.promote_types(hidden.dtype, torch.float32)
    return ((tuple(hidden.shape), hidden.dtype), (tuple(weight.shape), weight.dtype), ((weight.shape[0],), acc))


def _placeholder(slot: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The empty tensor that stands for an uncomputed slot (see above)."""
    return torch.empty((*shape[:-1], 0) if slot == 0 else (0,) * len(shape), dtype=dtype, device=device)


def _saved(grads, hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``grads`` (grad_hidden [N, H], grad_weight, grad_bias; None where not computed) as the
    fixed slots: grad_hidden viewed like hidden, a placeholder for each None."""
    return tuple(
        _placeholder(i, shape, dtype, hidden.device) if g is None else g.view(shape)
        for i, (g, (shape, dtype)) in enumerate(zip(grads, _slots(hidden, weight)))
    )


def make_split(chunk_fn: ChunkFn) -> Split:
    """The :class:`~polykernel.spec.Split` of an impl that runs this driver with ``chunk_fn``."""

    def forward(hidden, weight, target, bias, ignore_index, ls, reduction, ce_weight, softcap, z_loss, grad_mask):
        h2 = _rows(hidden)
        t = target.reshape(-1).long().contiguous()
        ex = extras(ce_weight, softcap, z_loss)
        acc = torch.promote_types(hidden.dtype, torch.float32)
        count = denominator(t, ignore_index, ce_weight, acc)
        if reduction == "none":
            losses, *_ = _walk(h2, weight, bias, t, ignore_index, ls, chunk_fn, None, ex=ex)
            return (reduce_rows(losses, count, reduction, target.shape),), _saved((None, None, None), hidden, weight)
        scale = grad_scale(torch.ones((), dtype=acc, device=h2.device), count, reduction, acc)
        losses, *grads = _walk(h2, weight, bias, t, ignore_index, ls, chunk_fn, scale, _needs(bias, grad_mask), ex)
        return (reduce_rows(losses, count, reduction, target.shape),), _saved(grads, hidden, weight)

    def backward(grads, saved, hidden, weight, target, bias, ignore_index, ls, reduction, ce_weight, softcap, z_loss, grad_mask):
        g, needs = grads[0], _needs(bias, grad_mask)
        if reduction == "none":
            acc = torch.promote_types(hidden.dtype, torch.float32)
            t = target.reshape(-1).long().contiguous()
            ex = extras(ce_weight, softcap, z_loss)
            _, gh, gw, gb = _walk(_rows(hidden), weight, bias, t, ignore_index, ls, chunk_fn, g.reshape(-1).to(acc), needs, ex)
        else:
            gh, gw, gb = (torch.mul(s, g) if need else None for s, need in zip(saved, needs))
        return [
            None if gh is None else gh.view(hidden.shape),
            gw,
            None,
            None if gb is None else gb.to(bias.dtype),
            None,
            None,
            None,
            None,
            None,
            None,
        ]

    def layout(hidden, weight, target, bias, ignore_index, ls, reduction, ce_weight, softcap, z_loss, grad_mask):
        needs = (False, False, False) if reduction == "none" else _needs(bias, grad_mask)
        return tuple(
            torch.empty(shape, dtype=dtype, device=hidden.device) if need else _placeholder(i, shape, dtype, hidden.device)
            for i, (need, (shape, dtype)) in enumerate(zip(needs, _slots(hidden, weight)))
        )

    return Split(forward=forward, backward=backward, layout=layout)
