"""Cross-entropy helpers shared by every backend's loss impls (row-chunked torch math).

The forward walks the rows in chunks (upcast, logsumexp, target logit, row mean) and keeps the
fp32 LSE per row; the backward walks them again and writes ``softmax - (1-ε)·onehot - ε/V``
scaled per row: fp32 temporaries are O(TEMP_BYTES), never O(N·V). The helpers (``loss_and_grad``,
``grad_from_lse``, ``reduce_rows``, ``grad_scale``, ``scale_grads_``, ``differentiable``) live
here, not in ``backends/torch``, so that no backend imports another (issue 36).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..ops import _autocast
from ..ops.cross_entropy import mean_divisor

TEMP_BYTES = 64 << 20  # fp32 bytes of one chunk of upcast rows (a few such temporaries live at once)


def _step(v: int) -> int:
    return max(1, TEMP_BYTES // (4 * max(v, 1)))


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


class Extras(NamedTuple):
    """The cross-entropy options beyond smoothing (``polykernel.ops.cross_entropy``'s docstring):
    class weights ``[V]`` (or None), softcap (or None), z_loss (0: off)."""

    weight: torch.Tensor | None = None
    softcap: float | None = None
    z_loss: float = 0.0

    @property
    def any(self) -> bool:
        return self.weight is not None or self.softcap is not None or bool(self.z_loss)


NO_EXTRAS = Extras()


def extras(weight: torch.Tensor | None, softcap: float | None, z_loss: float) -> Extras:
    """The options as one value (the shared ``NO_EXTRAS`` when all are off: the hot path's test)."""
    if weight is None and softcap is None and not z_loss:
        return NO_EXTRAS
    return Extras(weight, softcap, float(z_loss))


def denominator(t: torch.Tensor, ignore_index: int, weight: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """A mean's divisor: the count of scored targets (0-d int64), or with class weights their
    summed weights (0-d ``dtype``; out-of-range targets read a clamped index: their rows are
    flagged by the kernels, never read out of bounds here), NaN where that sum is 0
    (:func:`polykernel.ops.cross_entropy.mean_divisor`: NaN loss and scored rows' gradients, as
    ``F.cross_entropy``; the consumers zero the ignored rows' scale)."""
    valid = t != ignore_index
    if weight is None:
        return valid.sum()
    v = weight.shape[0]
    w = weight.to(dtype)[torch.where(valid, t, 0).clamp_(0, max(v - 1, 0))]
    return mean_divisor(torch.where(valid, w, 0.0).sum())


def _targets(target: torch.Tensor, ignore_index: int, v: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(valid, out_of_range, t): ``t`` the target with ignored and out-of-range entries read as
    class 0, so nothing indexes out of bounds. An out-of-range target (not ignore_index, outside
    ``[0, V)``; the public function refuses it on the CPU, the host does not look on a GPU) stays
    a scored row whose loss and gradient are NaN, as the kernels flag it: no device-side assert
    (the first-use check runs this impl first, on the caller's values), no finite loss from it."""
    valid = target != ignore_index
    bad = valid & ((target < 0) | (target >= v))
    return valid, bad, torch.where(valid & ~bad, target, 0)


def _flag(rows: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    """NaN on the out-of-range rows of a per-row tensor (loss or gradient scale): an [n] op."""
    return torch.where(bad, torch.nan, rows)


def _target_weight(ex: Extras, t: torch.Tensor, valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """w[t] per row (1 without weights), 0 on ignored rows; ``t`` already 0 there."""
    if ex.weight is None:
        return valid.to(dtype)
    return torch.where(valid, ex.weight.to(dtype)[t], 0.0)


def _capped(xf: torch.Tensor, ex: Extras) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logits after the softcap, tanh of them over softcap or None)."""
    if ex.softcap is None:
        return xf, None
    th = torch.tanh(xf / ex.softcap)
    return th * ex.softcap, th


def _rows_ex(xf: torch.Tensor, t: torch.Tensor, valid: torch.Tensor, ls: float, ex: Extras):
    """Per-row (loss, lse, softcapped logits, tanh or None, w[t]) for one chunk with options."""
    z, th = _capped(xf, ex)
    lse = torch.logsumexp(z, -1)
    lse = torch.where(torch.isposinf(lse), torch.nan, lse)  # as in loss_and_grad
    wt = _target_weight(ex, t, valid, z.dtype)
    r = (1.0 - ls) * wt * (lse - z.gather(1, t[:, None]).squeeze(1))
    if ls:
        v = z.shape[1]
        if ex.weight is None:
            r = r + ls * (lse - z.mean(-1))
        else:
            w = ex.weight.to(z.dtype)
            with _autocast.off(z.device.type):  # a matmul, which autocast would round to 16 bits
                zw = z @ w
            r = r + (ls / v) * (lse * w.sum() - zw)
    if ex.z_loss:
        r = r + ex.z_loss * wt * lse.square()
    return torch.where(valid, r, 0.0), lse, z, th, wt


def _row_grad_ex(
    z: torch.Tensor,
    th: torch.Tensor | None,
    t: torch.Tensor,
    valid: torch.Tensor,
    lse: torch.Tensor,
    wt: torch.Tensor,
    scale: torch.Tensor,
    ls: float,
    ex: Extras,
) -> torch.Tensor:
    """The scaled gradient w.r.t. the raw logits of one chunk with options (a new fp32 tensor):
    ``p·a - (1-ε)·w[t]·onehot - ε/V·w``, ``a = (1-ε)·w[t] + ε/V·Σw + 2·z_loss·w[t]·lse``,
    times ``1 - tanh²`` under a softcap."""
    v = z.shape[1]
    p = (z - lse[:, None]).exp_()
    wsum = float(v) if ex.weight is None else ex.weight.to(z.dtype).sum()
    a = (1.0 - ls) * wt + (ls / v) * wsum
    if ex.z_loss:
        a = a + (2.0 * ex.z_loss) * wt * lse
    p.mul_(a[:, None])
    if ls:
        if ex.weight is None:
            p.sub_(ls / v)
        else:
            p.sub_((ls / v) * ex.weight.to(z.dtype)[None, :])
    p.scatter_add_(1, t[:, None], ((ls - 1.0) * wt)[:, None])
    if th is not None:
        p.mul_(1.0 - th.square())
    # masked, not multiplied by 0: an ignored row's non-finite logits must give 0 (the op's docstring)
    return p.mul_(scale.to(p.dtype).expand(p.shape[0])[:, None]).masked_fill_(~valid[:, None], 0.0)


def _row_grad(xf: torch.Tensor, t: torch.Tensor, valid: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor, ls: float) -> torch.Tensor:
    """``(softmax - (1-ε)·onehot - ε/V) · scale`` for one chunk, in fp32 (a new tensor)."""
    p = (xf - lse[:, None]).exp_()
    if ls:
        p.sub_(ls / xf.shape[1])
    # In p's dtype from the start: torch.where of two Python scalars is fp32, so an fp64 one-hot
    # weight -(1 - ε) would carry fp32 rounding into fp64 gradients.
    hot = valid.to(p.dtype).mul_(ls - 1.0)
    p.scatter_add_(1, t[:, None], hot[:, None])
    # masked, not multiplied by 0: an ignored row's non-finite logits must give 0 (the op's docstring)
    return p.mul_(scale.to(p.dtype).expand(p.shape[0])[:, None]).masked_fill_(~valid[:, None], 0.0)


def loss_and_grad(
    x: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    ls: float,
    scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    ex: Extras = NO_EXTRAS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row loss and LSE of ``x [n, V]`` (fp32, fp64 for fp64 x); ``target [n]`` int64.

    With ``out`` (``[n, V]`` in x's dtype; it may be ``x`` itself), also writes the gradient
    scaled by ``scale`` (a 0-d or ``[n]`` tensor; ignored rows get 0). ``ex``: the options.
    """
    n, v = x.shape
    acc = _acc(x.dtype)
    loss = torch.empty(n, dtype=acc, device=x.device)
    lse = torch.empty(n, dtype=acc, device=x.device)
    valid, bad, t = _targets(target, ignore_index, v)
    if out is not None:  # a NaN scale makes the whole row of the gradient NaN
        scale = _flag(scale.to(acc).expand(n), bad)  # type: ignore[union-attr]
    step = _step(v)
    for s in range(0, n, step):
        e = min(n, s + step)
        xf = x[s:e].to(acc)
        if ex.any:
            r, lse_c, z, th, wt = _rows_ex(xf, t[s:e], valid[s:e], ls, ex)
            loss[s:e], lse[s:e] = r, lse_c
            if out is not None:
                out[s:e].copy_(_row_grad_ex(z, th, t[s:e], valid[s:e], lse_c, wt, scale[s:e], ls, ex))  # type: ignore[index]
            continue
        # A +inf logit: logsumexp gives +inf (and the loss +inf), the reference's log_softmax NaN
        # (inf - inf); the reference's answer is the op's, so make it NaN here too.
        lse_c = torch.logsumexp(xf, -1)
        lse_c = torch.where(torch.isposinf(lse_c), torch.nan, lse_c)
        r = lse_c - (1.0 - ls) * xf.gather(1, t[s:e, None]).squeeze(1)
        if ls:
            r = r - ls * xf.mean(-1)
        loss[s:e] = torch.where(valid[s:e], r, 0.0)
        lse[s:e] = lse_c
        if out is not None:
            out[s:e].copy_(_row_grad(xf, t[s:e], valid[s:e], lse_c, scale[s:e], ls))  # type: ignore[index]
    return _flag(loss, bad), lse


def grad_from_lse(
    x: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor, ignore_index: int, ls: float, ex: Extras = NO_EXTRAS
) -> torch.Tensor:
    """The scaled gradient ``[n, V]`` in x's dtype, recomputed from x and the saved LSE."""
    n, v = x.shape
    acc = _acc(x.dtype)
    out = torch.empty((n, v), dtype=x.dtype, device=x.device)
    valid, bad, t = _targets(target, ignore_index, v)
    scale = _flag(scale.to(acc).expand(n), bad)
    step = _step(v)
    for s in range(0, n, step):
        e = min(n, s + step)
        if ex.any:
            z, th = _capped(x[s:e].to(acc), ex)
            wt = _target_weight(ex, t[s:e], valid[s:e], acc)
            out[s:e].copy_(_row_grad_ex(z, th, t[s:e], valid[s:e], lse[s:e], wt, scale[s:e], ls, ex))
            continue
        out[s:e].copy_(_row_grad(x[s:e].to(acc), t[s:e], valid[s:e], lse[s:e], scale[s:e], ls))
    return out


def reduce_rows(loss: torch.Tensor, count: torch.Tensor, reduction: str, shape: torch.Size) -> torch.Tensor:
    """mean = sum / (non-ignored count): 0/0 = NaN for an empty or all-ignored batch, as PyTorch."""
    if reduction == "mean":
        return loss.sum() / count.to(loss.dtype)
    if reduction == "sum":
        return loss.sum()
    # Not a view of the rows buffer: an autograd Function's output that is a view cannot be
    # modified in place (``loss.mul_(2)``, ``loss[0] = 0``), and F.cross_entropy's can.
    return loss.view(shape).detach()


def grad_scale(g: torch.Tensor, count: torch.Tensor, reduction: str, dtype: torch.dtype) -> torch.Tensor:
    """Per-row gradient scale: a 0-d tensor (mean/sum) or ``[n]`` (none). Ignored rows are
    zeroed by the consumers, so the ``inf`` of an all-ignored mean never reaches a gradient."""
    if reduction == "mean":
        return (g.to(dtype) / count.to(dtype)).reshape(())
    if reduction == "sum":
        return g.to(dtype).reshape(())
    return g.reshape(-1).to(dtype)


def scale_grads_(g: torch.Tensor, *grads: torch.Tensor | None) -> None:
    """Multiply gradients computed for ``grad_output = 1`` by the real scalar ``g``, in place.

    Outside CUDA-graph capture ``g`` is read on the host (one sync, which skipping the multiply
    for ``g == 1`` needs anyway) and applied as a Python number: a 0-d CUDA tensor operand makes
    TensorIterator broadcast it and take its non-vectorized path (the fused linear CE's 1 GiB bf16
    grad_weight: a quarter of copy speed, benchmarks/results/h200-2026-11-30-ncu/ncu_flce.md), a
    host scalar keeps the vectorized one.
    ``g / k`` from gradient accumulation or a loss scaler is the usual case of ``g != 1``.
    """
    capturing = g.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    factor: torch.Tensor | float = g
    if not capturing and g.numel() == 1:
        factor = g.item()
        if factor == 1:
            return
    for t in grads:
        if t is not None:
            t.mul_(factor)


def differentiable(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    ls: float,
    reduction: str,
    weight: torch.Tensor | None = None,
    softcap: float | None = None,
    z_loss: float = 0.0,
) -> torch.Tensor:
    """The op in differentiable torch ops (``F.cross_entropy`` in the accumulation dtype, fp64 for
    fp64 logits): the path under functorch transforms and of a create_graph backward."""
    v = logits.shape[-1]
    acc = _acc(logits.dtype)
    t = target.reshape(-1).long()
    x = torch.where((t != ignore_index)[:, None], logits.reshape(-1, v).to(acc), 0.0)  # as the reference
    if weight is None and softcap is None and not z_loss:
        out = F.cross_entropy(x, t, ignore_index=ignore_index, label_smoothing=ls, reduction=reduction)
        return out.reshape(target.shape) if reduction == "none" else out
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    w = None if weight is None else weight.to(acc)
    rows = F.cross_entropy(x, t, weight=w, ignore_index=ignore_index, label_smoothing=ls, reduction="none")
    valid = t != ignore_index
    wt = valid.to(acc) if w is None else torch.where(valid, w[torch.where(valid, t, 0)], 0.0)
    if z_loss:
        rows = rows + z_loss * wt * torch.logsumexp(x, -1).square()
    if reduction == "none":
        return rows.reshape(target.shape)
    total = torch.where(valid, rows, 0.0).sum()
    if reduction == "sum":
        return total
    scored = valid.any()  # as the reference: NaN with zero gradients when nothing is scored
    return torch.where(scored, total / torch.where(scored, mean_divisor(wt.sum()), 1.0), torch.nan)
