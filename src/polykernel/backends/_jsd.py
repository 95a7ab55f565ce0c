"""Row-chunked jsd math shared by every backend's impls (the torch impl's, and triton's graph gradients);
here, not in ``backends/torch``, so that no backend imports another (issue 36)."""

from __future__ import annotations

import torch

from ._cross_entropy import TEMP_BYTES


def _step(v: int) -> int:
    return max(1, TEMP_BYTES // (4 * max(v, 1)))


def terms(x: torch.Tensor, y: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(term, d term / dx) per element of student log-probs ``x`` and teacher log-probs ``y``
    (fp32 or fp64 ``[rows, V]``): the op's terms in closed form (a probability of 0 adds 0)."""
    if beta == 0:
        p = y.exp()
        return torch.where(p == 0, 0.0, p * (y - x)), -p
    if beta == 1:
        q = x.exp()
        term = torch.where(q == 0, 0.0, q * (x - y))
        return term, torch.where(q == 0, 0.0, term + q)
    p, q = y.exp(), x.exp()
    m = torch.maximum(x, y)
    m = torch.where(m == float("-inf"), 0.0, m)  # both -inf: any finite shift (both terms are 0)
    log_m = m + torch.log(beta * (y - m).exp() + (1.0 - beta) * (x - m).exp())
    tq = torch.where(q == 0, 0.0, (1.0 - beta) * q * (x - log_m))
    return torch.where(p == 0, 0.0, beta * p * (y - log_m)) + tq, tq


def count_and_scale(labels: torch.Tensor | None, ignore_index: int, rows: int, acc: torch.dtype, device: torch.device):
    """(valid [rows] bool or None, the count of scored rows, 1/count): tensors on the device when
    there are labels (no host sync), numbers otherwise. 1/0 is inf: the ignored rows' gradients
    are masked to 0, and the mean is 0/0 = NaN."""
    if labels is None:
        return None, rows, (1.0 / rows if rows else float("inf"))
    valid = labels.reshape(-1) != ignore_index
    count = valid.sum()
    return valid, count, torch.reciprocal(count.to(acc))


def _walk(x2, y2, valid, beta, scale, acc, grad: bool):
    """Row sums (masked to the scored rows) and, with ``grad``, the scaled gradient."""
    n, v = x2.shape
    rows = torch.empty(n, dtype=acc, device=x2.device)
    dx = torch.empty(x2.shape, dtype=x2.dtype, device=x2.device) if grad else None
    step = _step(v)
    for s in range(0, n, step):
        e = min(n, s + step)
        term, d = terms(x2[s:e].to(acc), y2[s:e].to(acc), beta)
        r = term.sum(-1)
        ok = None if valid is None else valid[s:e]
        rows[s:e] = r if ok is None else torch.where(ok, r, 0.0)
        if dx is not None:
            c = scale if ok is None else torch.where(ok, scale, 0.0)[:, None]  # ignored rows: 0 (never inf·0)
            dx[s:e] = torch.where(c == 0, 0.0, d * c) if ok is not None else d * c
    return rows, dx
