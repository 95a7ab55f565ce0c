"""Row-chunked tvd math shared by every backend's impls (the torch impl's, and triton's graph gradients);
here, not in ``backends/torch``, so that no backend imports another (issue 36)."""

from __future__ import annotations

import torch

from ._cross_entropy import TEMP_BYTES


def _step(v: int) -> int:
    return max(1, TEMP_BYTES // (4 * max(v, 1)))


def divide(reduction: str, count, v: int, acc: torch.dtype = torch.float32):
    """(the loss's divisor, the gradients' 1/divisor): numbers or device tensors like count."""
    div = count * v if reduction == "mean" else count if reduction == "batchmean" else 1
    if isinstance(div, torch.Tensor):
        return div, torch.reciprocal(div.to(torch.float64)).to(acc)
    return div, (1.0 / div if div else float("inf"))


def _walk(p2, q2, valid, acc, reduction, c, need_p, need_q, cot=None):
    """One pass: the loss (summed, or elementwise for "none") and, when asked, the gradients
    times ``c`` (a number or 0-d tensor) or the elementwise ``cot``; ignored rows get 0."""
    n, v = p2.shape
    none = reduction == "none"
    out = torch.empty((n, v), dtype=acc, device=p2.device) if none and cot is None else None
    total = torch.zeros((), dtype=acc, device=p2.device)
    gp = torch.empty(p2.shape, dtype=p2.dtype, device=p2.device) if need_p else None
    gq = torch.empty(q2.shape, dtype=q2.dtype, device=q2.device) if need_q else None
    step = _step(v)
    for s in range(0, n, step):
        e = min(n, s + step)
        d = p2[s:e].to(acc) - q2[s:e].to(acc)
        ok = None if valid is None else valid[s:e, None]
        if cot is None:
            loss = 0.5 * d.abs()
            if ok is not None:
                loss = torch.where(ok, loss, 0.0)
            if out is not None:
                out[s:e] = loss
            else:
                total += loss.sum()
        if need_p or need_q:
            scale = c if cot is None else cot[s:e].to(acc)
            g = 0.5 * torch.sign(d) * scale
            if ok is not None:
                g = torch.where(ok, g, 0.0)
            if gp is not None:
                gp[s:e] = g
            if gq is not None:
                gq[s:e] = -g
    return (out if out is not None else total), gp, gq


def graph_grads(p2, q2, valid, acc, g, need_p: bool, need_q: bool, unit=None):
    """The create_graph backward's (dp, dq): ``±0.5·sign(p - q)·g`` (0 for ignored rows) with a
    graph to the cotangent ``g`` only, as the reference's: sign is constant almost everywhere, so
    its second derivative in p and q is 0. ``unit``: the forward's gradients for a unit scalar
    cotangent (a scalar reduction; p2, q2, valid are then unused), else ``g`` is elementwise."""
    if unit is not None:
        return tuple(None if u is None else u * g for u in unit)
    s = 0.5 * torch.sign(p2.detach().to(acc) - q2.detach().to(acc)) * g.reshape(p2.shape).to(acc)
    if valid is not None:
        s = torch.where(valid.reshape(-1, 1), s, 0.0)
    return (s.to(p2.dtype) if need_p else None), ((-s).to(q2.dtype) if need_q else None)
