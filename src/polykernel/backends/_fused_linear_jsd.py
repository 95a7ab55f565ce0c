"""Fused linear JSD's chunked driver, shared by every backend's impl of the op (here, not in
``backends/torch``, so that no backend imports another; issue 36): neither ``[N, V]`` logits ever held for all rows.

``run`` is the chunked driver shared by every impl of the op; an impl passes its per-chunk JSD
(``chunk_fn``), which turns a chunk's fp32 logits into per-row losses and, when asked, writes the
scaled dlogits into a buffer of the inputs' dtype. Per chunk of ``chunk_rows`` rows::

    zs = hs[c] @ Ws.T;  zt = ht[c] @ Wt.T         (fp32 results of the inputs' values)
    loss[c] = chunk_fn(zs, zt, ...)                (-> dz, the student's dlogits)
    grad_hidden[c] = dz @ Ws;  grad_weight += dz.T @ hs[c]

with both heads' classes padded to a multiple of 16 bytes for the matmuls (``core.aligned_head``).

Peak extra memory: one chunk's two fp32 logits and its dlogits (``CHUNK_BYTES`` in all; the torch
chunk_fn's temporaries are a few more fp32 chunks, so it takes a quarter of it), besides the
gradients themselves.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..core.aligned_head import aligned_head, own_rows
from ..core.cpu_gemm import mm
from ..ops import _autocast
from ..ops._distill import acc_dtype, rows_view

# the chunking lives in the op file: its error model counts on it
from ..ops.fused_linear_jsd import CHUNK_BYTES, OP_ID, chunk_rows
from ._cross_entropy import scale_grads_
from ._double_backward import anchor, refuse
from ._jsd import count_and_scale

ChunkFn = Callable[..., torch.Tensor]


# torch.mm(..., out_dtype=) (aten::mm.dtype): torch >= 2.8, CUDA only
_MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype")


def projector(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """``h -> h @ weight.T`` as an fp32 (fp64 for fp64) result of the inputs' values: one matmul
    with an fp32 output on CUDA (the products of 16-bit values are exact in fp32 and the GEMM
    accumulates in fp32), an fp32 copy of the weight made once elsewhere (the CPU, an older
    torch)."""
    acc = acc_dtype(weight)
    if weight.dtype == acc:
        return lambda h: torch.mm(h, weight.t())
    if weight.device.type == "cuda" and _MM_OUT_DTYPE:
        return lambda h: torch.mm(h, weight.t(), out_dtype=acc)
    w_acc = weight.to(acc)
    return lambda h: torch.mm(h.to(acc), w_acc.t())


def _walk(hs2, ws, ht2, wt, labels, beta, ignore_index, temperature, chunk_fn, needs, budget):
    """One walk over the row chunks: the loss and, with ``needs`` (hidden, weight), the
    gradients of the student for a unit cotangent."""
    n, h = hs2.shape
    v = ws.shape[0]
    dev = hs2.device
    acc = acc_dtype(hs2, ht2)
    _, count, scale = count_and_scale(labels, ignore_index, n, acc, dev)
    grads = needs[0] or needs[1]
    losses = torch.empty(n, dtype=acc, device=dev)
    # both heads padded to 16 bytes of the narrower dtype for the matmuls (core.aligned_head): zero
    # rows, whose logits are zero and whose dlogits are cleared below, so they add exact zeros
    elt = min(hs2.element_size(), ht2.element_size())
    ws_k, wt_k = aligned_head(ws, None, elt)[0], aligned_head(wt, None, elt)[0]
    vp = ws_k.shape[0]
    gh = torch.empty((n, h), dtype=hs2.dtype, device=dev) if needs[0] else None
    gw = torch.empty((vp, h), dtype=ws.dtype, device=dev) if needs[1] else None
    if gw is not None and n == 0:
        gw.zero_()
    proj_s, proj_t = projector(ws_k), projector(wt_k)
    inv_t = 1.0 / temperature
    step = chunk_rows(v, hs2.element_size(), n, budget)  # (of V, not Vp: the error model counts these chunks)
    for s in range(0, n, step):
        e = min(n, s + step)
        hc = hs2[s:e]
        zs_full, zt_full = proj_s(hc), proj_t(ht2[s:e])
        dz_full = dz = None
        if grads:  # in place over the student's logits when they have the inputs' dtype
            dz_full = zs_full if zs_full.dtype == hs2.dtype else torch.empty((e - s, vp), dtype=hs2.dtype, device=dev)
            dz = dz_full[:, :v]
        lab = None if labels is None else labels[s:e]
        zs, zt = zs_full[:, :v], zt_full[:, :v]
        losses[s:e] = chunk_fn(zs, zt, lab, beta, ignore_index, inv_t, scale if grads else None, dz)
        del zt, zt_full
        if dz_full is not None and vp != v:
            dz_full[:, v:].zero_()
        if gh is not None:
            mm(dz_full, ws_k, out=gh[s:e])
        if gw is not None:
            if s == 0:
                torch.mm(dz_full.t(), hc, out=gw)
            else:
                gw.addmm_(dz_full.t(), hc)
        del zs, zs_full, dz, dz_full
    return losses.sum() / count, gh, own_rows(gw, v)


class _FusedLinearJSD(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hs, ws, ht, wt, labels, beta, ignore_index, temperature, chunk_fn, scale_fn, budget, impl):  # type: ignore[override]
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        lab = None if labels is None else labels.reshape(-1).contiguous()
        loss, gh, gw = _walk(
            rows_view(hs), ws, rows_view(ht.detach()), wt.detach(), lab, beta, ignore_index, temperature, chunk_fn, needs, budget
        )
        ctx.grads, ctx.scale_fn, ctx.shape, ctx.impl = (gh, gw), scale_fn, hs.shape, impl
        with torch.enable_grad():  # handles on the inputs' graph, for refuse()
            ctx.save_for_backward(anchor(hs), anchor(ws))
        return loss

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        if ctx.grads is None:
            raise RuntimeError(
                "polykernel fused_linear_jsd: backward ran twice through the same graph; its gradients were computed in "
                "the forward and are consumed by the first backward (retain_graph is not supported)"
            )
        (gh, gw), ctx.grads = ctx.grads, None
        if torch.is_grad_enabled():  # create_graph=True: the gradients are made chunk by chunk, without a graph
            gh, gw = (None if x is None else x * g for x in (gh, gw))
            why = "its gradients are computed chunk by chunk in the forward; for higher derivatives use F.linear, log_softmax and polykernel.jsd"
            gh, gw = refuse(OP_ID, ctx.impl, why, (*ctx.saved_tensors, g if g.requires_grad else None), gh, gw)
        else:
            ctx.scale_fn(g, gh, gw)
        return (None if gh is None else gh.view(ctx.shape)), gw, None, None, None, None, None, None, None, None, None, None


def run(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    labels: torch.Tensor | None,
    beta: float,
    ignore_index: int,
    temperature: float,
    chunk_fn: ChunkFn,
    scale_fn: Callable[..., None] = scale_grads_,
    budget: int | None = None,
    impl: str = "torch",
) -> torch.Tensor:
    """The op on validated arguments, with ``chunk_fn`` as the per-chunk JSD and ``scale_fn(g,
    *grads)`` multiplying the forward's gradients by the cotangent in backward; ``budget``: the
    chunk's bytes (default ``CHUNK_BYTES``); ``impl``: the caller's name, for errors."""
    budget = CHUNK_BYTES if budget is None else budget
    device = student_hidden.device.type
    if _autocast.enabled(device):  # both heads as F.linear there (ops._autocast)
        cast = _autocast.as_linear(device, student_hidden, student_weight, teacher_hidden, teacher_weight)
        with _autocast.off(device):
            return run(*cast, labels, beta, ignore_index, temperature, chunk_fn, scale_fn, budget, impl)  # type: ignore[arg-type]
    if torch.is_grad_enabled() and (student_hidden.requires_grad or student_weight.requires_grad):
        return _FusedLinearJSD.apply(
            student_hidden,
            student_weight,
            teacher_hidden,
            teacher_weight,
            labels,
            beta,
            ignore_index,
            temperature,
            chunk_fn,
            scale_fn,
            budget,
            impl,
        )
    lab = None if labels is None else labels.reshape(-1).contiguous()
    loss, _, _ = _walk(
        rows_view(student_hidden), student_weight, rows_view(teacher_hidden), teacher_weight, lab, beta, ignore_index, temperature,
        chunk_fn, (False, False), budget,
    )  # fmt: skip
    return loss
