"""Triton cross-entropy: forward and backward, V up to 256K+ (any V), fp32 math.

One kernel, one program per row, two optional passes over the row in BLOCK-wide chunks:
- FWD: online softmax (running max and sum of exp2), the target logit by one scalar load and,
  with label smoothing, the row sum; writes the row's loss and LSE (fp32).
- GRAD: ``(exp(x - lse) - ε/V - (1-ε)·[col == t]) · scale`` in the logits' dtype, where scale
  is a per-row or scalar fp32 value read from device memory (``grad_output / count`` for a
  mean), so no host sync is ever needed.
The registered impl runs FWD in the forward and GRAD in the backward (re-reading the logits with
the saved LSE): 3·N·V·elt bytes for fwd+bwd, no N·V buffer alive between them, grad_output
folded in for free. ``GRAD_IN_FORWARD = True`` switches to one FWD+GRAD launch in the forward
(the row's second read may hit L2) and an in-place ``dx *= grad_output`` in the backward,
skipped when grad_output is exactly 1 (a sync); which is faster on the H200 is for the
benchmark to say. The fused linear cross-entropy uses FWD+GRAD per chunk, in place.

Options (``polykernel.ops.cross_entropy``'s docstring), each a ``tl.constexpr`` flag so that the
plain kernel is the same code as without them: ``HAS_W`` (class weights: ``w[t]`` per row, ``w``
per element only with smoothing; their sum from a device scalar, no sync), ``CAP`` (softcap:
``cap·tanh(x/cap)`` on every load, ``1 - tanh²`` in the gradient), ``ZL`` (z-loss: ``z·w[t]·lse²``
in the loss, ``2·z·w[t]·lse·p`` in the gradient).

Ignored rows load nothing (their loads are masked off) and get loss 0 and gradient 0. A row whose
target is neither in [0, V) nor ignore_index never reads out of bounds and gets a NaN loss and a
NaN gradient row (the host does not check on CUDA: that would sync).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...ops.cross_entropy import OP_ID, reference  # noqa: F401  (reference: semantics live in the op file)
from ...spec import Split
from .._cross_entropy import NO_EXTRAS, Extras, denominator, differentiable, extras, grad_scale, reduce_rows
from .._double_backward import anchor, graph_grads, refuse
from ._autograd import lean_apply
from ._autograd import transforms_active as _transforms_active
from ._launch import launch
from ._rows import as_rows as _as_rows
from ._rows import next_pow2 as _next_pow2
from ._scale import scale_grads_

GRAD_IN_FORWARD = False  # see the module docstring
MAX_BLOCK_BYTES = 32768  # one chunk of a row: 16K bf16 / 8K fp32 elements, 4 x 16-byte loads per thread

LOG2E = tl.constexpr(1.4426950408889634)


# ---------------------------------------------------------------------------------------------
# Kernel


@triton.jit
def _tanh(u):
    # exp2 form, odd by construction: tanh(±inf) = ±1, no overflow for large |u|
    a = tl.exp2(tl.abs(u) * (-2.0 * LOG2E))  # tensor first: constexpr * tensor stays a constexpr
    r = (1.0 - a) / (1.0 + a)
    return tl.where(u < 0, -r, r)


@triton.jit
def _ce_kernel(
    X,
    T,
    LOSS,
    LSE,
    DX,
    SCALE,
    W,
    WSUM,
    V,
    stride_x,
    stride_dx,
    stride_scale,
    ignore_index,
    smoothing,
    cap,
    zl,
    BLOCK: tl.constexpr,
    FWD: tl.constexpr,
    GRAD: tl.constexpr,
    SMOOTH: tl.constexpr,
    HAS_W: tl.constexpr = False,
    CAP: tl.constexpr = False,
    ZL: tl.constexpr = False,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    cols = tl.arange(0, BLOCK)
    t = tl.load(T + row).to(tl.int64)
    valid = t != ignore_index
    bad = valid & ((t < 0) | (t >= V))
    n_load = tl.where(valid, V, 0)  # ignored rows read nothing
    in_range = valid & (t >= 0) & (t < V)
    if HAS_W:
        wt = tl.load(W + t, mask=in_range, other=0.0).to(tl.float32)
        wsum = tl.load(WSUM).to(tl.float32)
    else:
        wt = 1.0
        wsum = V * 1.0
    if FWD:
        # first chunk peeled so the running values start as fp32 scalars
        mask = cols < n_load
        x = tl.load(x_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
        if CAP:
            x = tl.where(mask, cap * _tanh(x / cap), float("-inf"))
        m = tl.max(x, axis=0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        s = tl.sum(tl.exp2((x - m_safe) * LOG2E), axis=0)
        if SMOOTH:
            if HAS_W:
                sx = tl.sum(tl.where(mask, x * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32), 0.0), axis=0)
            else:
                sx = tl.sum(tl.where(mask, x, 0.0), axis=0)
        for start in range(BLOCK, V, BLOCK):
            offs = start + cols
            mask = offs < n_load
            x = tl.load(x_row + offs, mask=mask, other=float("-inf")).to(tl.float32)
            if CAP:
                x = tl.where(mask, cap * _tanh(x / cap), float("-inf"))
            m_new = tl.maximum(m, tl.max(x, axis=0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            s = s * tl.exp2((m - m_safe) * LOG2E) + tl.sum(tl.exp2((x - m_safe) * LOG2E), axis=0)
            m = m_new
            if SMOOTH:
                if HAS_W:
                    sx += tl.sum(tl.where(mask, x * tl.load(W + offs, mask=mask, other=0.0).to(tl.float32), 0.0), axis=0)
                else:
                    sx += tl.sum(tl.where(mask, x, 0.0), axis=0)
        # ignored rows (s = 0): a finite LSE, so the GRAD pass stays finite
        lse = tl.where(valid, m + tl.log(tl.where(valid, s, 1.0)), 0.0)
        xt = tl.load(x_row + t, mask=in_range, other=0.0).to(tl.float32)
        if CAP:
            xt = cap * _tanh(xt / cap)
        if HAS_W:
            loss = (1.0 - smoothing) * wt * (lse - xt)
            if SMOOTH:
                loss += (smoothing / V) * (lse * wsum - sx)
        else:
            loss = lse - (1.0 - smoothing) * xt
            if SMOOTH:
                loss -= smoothing * (sx / V)
        if ZL:
            loss += zl * wt * lse * lse
        loss = tl.where(valid, loss, 0.0)
        loss = tl.where(bad, float("nan"), loss)
        tl.store(LOSS + row, loss)
        tl.store(LSE + row, lse)
    else:
        lse = tl.load(LSE + row)
    if GRAD:
        scale = tl.load(SCALE + row * stride_scale).to(tl.float32)
        scale = tl.where(valid, scale, 0.0)  # 0 even when scale is inf (all-ignored mean)
        scale = tl.where(bad, float("nan"), scale)
        eps = smoothing / V
        # softmax's coefficient: (1-ε)·w[t] + ε/V·Σw + 2·z·w[t]·lse (1 + 2·z·lse without weights)
        coef = (1.0 - smoothing) * wt + eps * wsum
        if ZL:
            coef += 2.0 * zl * wt * lse
        t32 = t.to(tl.int32)  # an in-range target fits; an out-of-range one has a NaN row anyway
        dx_row = DX + row * stride_dx
        for start in range(0, V, BLOCK):
            offs = start + cols
            x = tl.load(x_row + offs, mask=offs < n_load, other=0.0).to(tl.float32)
            if CAP:
                th = _tanh(x / cap)
                x = cap * th
            p = tl.exp2((x - lse) * LOG2E)
            if HAS_W or ZL:
                p *= coef
            if SMOOTH:
                if HAS_W:
                    p -= eps * tl.load(W + offs, mask=offs < n_load, other=0.0).to(tl.float32)
                else:
                    p -= eps
            if HAS_W:
                p = tl.where(offs == t32, p - (1.0 - smoothing) * wt, p)
            else:
                p = tl.where(offs == t32, p - (1.0 - smoothing), p)
            if CAP:
                p *= 1.0 - th * th
            tl.store(dx_row + offs, (p * scale).to(DX.dtype.element_ty), mask=offs < V)


# ---------------------------------------------------------------------------------------------
# Host launchers


def _config(v: int, elt: int) -> tuple[int, int]:
    """(BLOCK, num_warps): a 32 KB chunk per iteration for long rows, 16-byte accesses."""
    block = max(16, min(_next_pow2(v), MAX_BLOCK_BYTES // elt))
    warps = max(4, min(16, block * elt // 2048))
    return block, warps


def _launch(x2, t, loss, lse, dx, scale, ignore_index, ls, fwd, grad, ex=NO_EXTRAS) -> None:
    n, v = x2.shape
    block, warps = _config(v, x2.element_size())
    if ex is NO_EXTRAS:  # the plain kernel (the options' flags at their defaults)
        launch(
            _ce_kernel, (n,),
            x2, t, loss, lse,
            dx if grad else x2, scale if grad else lse, lse, lse,
            v, x2.stride(0), dx.stride(0) if grad else 0, (scale.stride(0) if scale.dim() else 0) if grad else 0,
            ignore_index, ls, 1.0, 0.0,
            BLOCK=block, FWD=fwd, GRAD=grad, SMOOTH=ls > 0, num_warps=warps,
        )  # fmt: skip
        return
    w = ex.weight
    if w is not None:
        w = w.contiguous()
        wsum = w.sum(dtype=torch.float32)
    launch(
        _ce_kernel, (n,),
        x2, t, loss, lse,
        dx if grad else x2, scale if grad else lse,
        lse if w is None else w, lse if w is None else wsum,
        v, x2.stride(0), dx.stride(0) if grad else 0, (scale.stride(0) if scale.dim() else 0) if grad else 0,
        ignore_index, ls, 1.0 if ex.softcap is None else ex.softcap, ex.z_loss,
        BLOCK=block, FWD=fwd, GRAD=grad, SMOOTH=ls > 0,
        HAS_W=w is not None, CAP=ex.softcap is not None, ZL=ex.z_loss != 0, num_warps=warps,
    )  # fmt: skip


def ce_forward(
    x2: torch.Tensor,
    t: torch.Tensor,
    ignore_index: int,
    ls: float,
    grad: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    ex: Extras = NO_EXTRAS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row loss and LSE (fp32 [n]) of ``x2 [n, V]`` (unit column stride), ``t [n]`` int.

    With ``grad`` (``[n, V]`` in x2's dtype, unit column stride; may be ``x2`` itself) and
    ``scale`` (fp32, 0-d or ``[n]``), also writes the scaled gradient in the same launch.
    ``ex``: the options (the LSE is that of the soft-capped logits).
    """
    n = x2.shape[0]
    loss = torch.empty(n, dtype=torch.float32, device=x2.device)
    lse = torch.empty(n, dtype=torch.float32, device=x2.device)
    if n:
        _launch(x2, t, loss, lse, grad, scale, ignore_index, ls, True, grad is not None, ex)
    return loss, lse


def ce_backward(
    x2: torch.Tensor, t: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor, ignore_index: int, ls: float, ex: Extras = NO_EXTRAS
) -> torch.Tensor:
    """The scaled gradient ``[n, V]`` in x2's dtype, from x2 and the saved LSE."""
    dx = torch.empty(x2.shape, dtype=x2.dtype, device=x2.device)
    if x2.shape[0]:
        _launch(x2, t, lse, lse, dx, scale, ignore_index, ls, False, True, ex)
    return dx


# ---------------------------------------------------------------------------------------------
# Registered impl


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ignore_index, ls, reduction, ex):  # type: ignore[override]
        v = logits.shape[-1]
        x2 = _as_rows(logits, v)
        t = target.reshape(-1).contiguous()
        count = (t != ignore_index).sum() if ex.weight is None else denominator(t, ignore_index, ex.weight, torch.float32)
        ctx.ignore_index, ctx.ls, ctx.reduction, ctx.shape, ctx.ex = ignore_index, ls, reduction, logits.shape, ex
        ctx.grad_in_forward = GRAD_IN_FORWARD and reduction != "none"
        if ctx.grad_in_forward:
            one = torch.ones((), dtype=torch.float32, device=x2.device)
            dx = torch.empty(x2.shape, dtype=x2.dtype, device=x2.device)
            loss, _ = ce_forward(x2, t, ignore_index, ls, dx, grad_scale(one, count, reduction, torch.float32), ex)
            ctx.dx = dx
            with torch.enable_grad():  # a handle on the input's graph, for refuse()
                ctx.save_for_backward(anchor(logits))
            return reduce_rows(loss, count, reduction, target.shape)
        loss, lse = ce_forward(x2, t, ignore_index, ls, ex=ex)
        # logits itself as well where x2 is another tensor (made here, without a graph): a
        # create_graph backward differentiates through it
        if x2 is logits:
            ctx.save_for_backward(x2, t, lse, count)
        else:
            ctx.save_for_backward(x2, t, lse, count, logits)
        return reduce_rows(loss, count, reduction, target.shape)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        if ctx.grad_in_forward:
            dx, ctx.dx = ctx.dx, None
            if dx is None:
                raise RuntimeError("polykernel cross_entropy (triton, GRAD_IN_FORWARD): backward ran twice; the gradient was consumed")
            scale_grads_(g, dx)
            if torch.is_grad_enabled():  # create_graph=True: this gradient carries no graph
                why = 'the gradient is computed in the forward (GRAD_IN_FORWARD); use impl="torch"'
                (dx,) = refuse(OP_ID, "triton", why, ctx.saved_tensors, dx)
        else:
            x2, t, lse, count, *inputs = ctx.saved_tensors
            if torch.is_grad_enabled():  # create_graph=True: a differentiable gradient, by the torch formula
                target = t.view(g.shape) if ctx.reduction == "none" else t
                args = (inputs[0] if inputs else x2, target, ctx.ignore_index, ctx.ls, ctx.reduction, *ctx.ex)
                grads = graph_grads(differentiable, args, (g,), (True,) + (False,) * 7)
                return grads[0], None, None, None, None, None
            dx = ce_backward(x2, t, lse, grad_scale(g, count, ctx.reduction, torch.float32), ctx.ignore_index, ctx.ls, ctx.ex)
        return dx.view(ctx.shape), None, None, None, None, None


_lean_apply = lean_apply(_CrossEntropy)  # _CrossEntropy.apply without its Python wrapper (see _autograd.py)


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    reduction: str,
    weight: torch.Tensor | None = None,
    softcap: float | None = None,
    z_loss: float = 0.0,
) -> torch.Tensor:
    """The registered impl (arguments already validated by ``polykernel.cross_entropy``)."""
    if _transforms_active():  # functorch (vmap, grad): the kernels cannot read its wrapped tensors
        return differentiable(logits, target, ignore_index, label_smoothing, reduction, weight, softcap, z_loss)
    ex = extras(weight, softcap, z_loss)
    if torch.is_grad_enabled() and logits.requires_grad:
        return _lean_apply(logits, target, ignore_index, label_smoothing, reduction, ex)
    v = logits.shape[-1]
    t = target.reshape(-1).contiguous()
    loss, _ = ce_forward(_as_rows(logits, v), t, ignore_index, label_smoothing, ex=ex)
    count = (t != ignore_index).sum() if weight is None else denominator(t, ignore_index, weight, torch.float32)
    return reduce_rows(loss, count, reduction, target.shape)


# Forward and backward as separate functions, for compiled graphs (polykernel.compile.library): the FWD
# pass in the forward, the GRAD pass on the saved LSE in the backward (GRAD_IN_FORWARD is for
# eager calls only). Saved layout: the torch impl's (LSE fp32 [rows], count 0-d int64; a weighted
# mean's divisor is recomputed from the arguments).
def _split_forward(logits, target, ignore_index, label_smoothing, reduction, weight, softcap, z_loss, grad_mask):
    t = target.reshape(-1).contiguous()
    ex = extras(weight, softcap, z_loss)
    loss, lse = ce_forward(_as_rows(logits, logits.shape[-1]), t, ignore_index, label_smoothing, ex=ex)
    count = (t != ignore_index).sum()
    den = count if weight is None else denominator(t, ignore_index, weight, torch.float32)
    return (reduce_rows(loss, den, reduction, target.shape),), (lse, count)


def _split_backward(grads, saved, logits, target, ignore_index, label_smoothing, reduction, weight, softcap, z_loss, grad_mask):
    lse, count = saved
    x2, t = _as_rows(logits, logits.shape[-1]), target.reshape(-1).contiguous()
    den = count if weight is None else denominator(t, ignore_index, weight, torch.float32)
    ex = extras(weight, softcap, z_loss)
    dx = ce_backward(x2, t, lse, grad_scale(grads[0], den, reduction, torch.float32), ignore_index, label_smoothing, ex)
    return [dx.view(logits.shape), None, None, None, None, None, None, None]


cross_entropy.split = Split(forward=_split_forward, backward=_split_backward)  # type: ignore[attr-defined]
