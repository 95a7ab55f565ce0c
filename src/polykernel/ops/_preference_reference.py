"""The float64 reference of the fused preference and RL losses: per-token log-probs of an LM head,
block by block (rows and vocabulary), differentiable, with what the error model reads of each call
(``_capture``: :mod:`._preference_error`); :mod:`._preference` re-exports the function."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .. import _compat
from ._head_blocks import float64_blocks

# The reference's calls with a gradient, captured for the error model (``_preference_error``): their
# arguments, log-probs and logit magnitudes.
_capture: list[list[dict[str, Any]]] = []


def reference_token_logps(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    ignore_index: int,
    temperature: float = 1.0,
) -> torch.Tensor:
    """``[R, T]`` log-probs of the ``[R, T, V]`` logits in float64 (differentiable), 0 where
    ``target == ignore_index``: the semantics the chunked impls are checked against.

    Computed over blocks of rows and of the vocabulary (:data:`REFERENCE_ROWS_ELEMENTS`,
    :data:`REFERENCE_VOCAB_BLOCK`), the weight converted to float64 a vocabulary block at a time
    and the backward recomputing each block's softmax: the whole float64 logits of a 1B model's
    batch are 8 GB, and with their softmax and gradient they made the first-call check of a TRL
    DPO step peak at 2.5x the step's own memory (benchmarks/results/h200-2026-12-04-third/trl/)."""
    if _compat.functorch_transforms_active():  # grad/jvp/vmap: plain ops (the Function has no functorch rules)
        return whole_logits_logps(hidden, weight, bias, target, ignore_index, temperature)
    stats: dict[str, Any] | None = {} if _capture and torch.is_grad_enabled() and _any_grad(hidden, weight, bias) else None
    lp = _ReferenceLogps.apply(hidden, weight, bias, target, ignore_index, float(temperature), stats)
    if stats is not None:
        _capture[-1].append({**stats, "hidden": hidden, "weight": weight, "bias": bias, "target": target, "ignore_index": ignore_index,
                             "temperature": float(temperature), "logps": lp})  # fmt: skip
    return lp


REFERENCE_VOCAB_BLOCK = 1 << 15  # vocabulary entries per block: a float64 weight block of 256 MiB at H = 1024
REFERENCE_ROWS_ELEMENTS = 1 << 25  # float64 logits per block (256 MiB): rows x vocabulary block


def _any_grad(*tensors: torch.Tensor | None) -> bool:
    return any(t is not None and t.requires_grad for t in tensors)


def _row_blocks(n: int, v: int):
    """``(start, end)`` of the row blocks: ``REFERENCE_ROWS_ELEMENTS`` logits of one vocabulary block each."""
    rows = max(1, REFERENCE_ROWS_ELEMENTS // max(1, min(v, REFERENCE_VOCAB_BLOCK)))
    for s in range(0, n, rows):
        yield s, min(s + rows, n)


def _vocab_blocks(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float):
    """``(start, end, weight block, z)`` over the vocabulary for the float64 rows ``h``: the float64
    logits ``(h·Wᵀ + b) / temperature`` of one block, and that block of the weight in float64."""
    for vs, ve, w, b in float64_blocks(weight, bias, REFERENCE_VOCAB_BLOCK):
        yield vs, ve, w, F.linear(h, w, b) / temperature


def _lse_and_target(h: torch.Tensor, weight, bias, temperature: float, safe: torch.Tensor, stats: dict[str, Any] | None):
    """The rows' logsumexp and target logit, one vocabulary block at a time (and the largest |z|)."""
    lses, zt = [], torch.zeros(h.shape[0], dtype=torch.float64, device=h.device)
    for vs, ve, _w, z in _vocab_blocks(h, weight, bias, temperature):
        lses.append(z.logsumexp(-1))
        inside = (safe >= vs) & (safe < ve)
        zt = torch.where(inside, z.gather(-1, (safe - vs).clamp(0, ve - vs - 1)[:, None]).squeeze(-1), zt)
        if stats is not None and z.numel():
            stats["z_max"] = max(stats.get("z_max", 0.0), z.abs().amax().item())
    return torch.stack(lses, -1).logsumexp(-1), zt


def _dlogits(h, weight, bias, temperature: float, lse, safe, g, valid):
    """``(vs, ve, weight block, dz)`` over the vocabulary: dz = g/t·(onehot − softmax) of one
    block (``g`` already divided by the temperature; dz exactly 0 on unscored rows, even where
    their logits are NaN or inf)."""
    rows = torch.arange(h.shape[0], device=h.device)
    for vs, ve, w, z in _vocab_blocks(h, weight, bias, temperature):
        dz = z.sub_(lse[:, None]).exp_().mul_(-g[:, None])  # −g·softmax, in place of the logits
        dz.masked_fill_(~valid[:, None], 0.0)
        inside = (safe >= vs) & (safe < ve)
        dz[rows[inside], safe[inside] - vs] += g[inside]
        yield vs, ve, w, dz


class _ReferenceLogps(torch.autograd.Function):
    """The float64 per-token log-probs, block by block; the backward recomputes each block's
    softmax instead of keeping ``[N, V]`` of it."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, ignore_index, temperature, stats):  # type: ignore[override]
        h2 = hidden.detach().reshape(-1, hidden.shape[-1])
        tg = target.reshape(-1)
        valid = tg != ignore_index
        safe = torch.where(valid, tg, 0)
        lp = torch.empty(h2.shape[0], dtype=torch.float64, device=h2.device)
        lse = torch.empty_like(lp)
        for s, e in _row_blocks(h2.shape[0], weight.shape[0]):
            lse[s:e], zt = _lse_and_target(h2[s:e].to(torch.float64), weight, bias, temperature, safe[s:e], stats)
            lp[s:e] = zt - lse[s:e]
        if stats is not None:  # the error model's magnitudes (_preference_error)
            stats.setdefault("z_max", 0.0)
            stats["lse_max"] = lse.abs().amax().item() if lse.numel() else 0.0
            stats["lse"] = lse
        ctx.save_for_backward(hidden, weight, bias, safe, valid, lse)
        ctx.temperature = temperature
        return torch.where(valid, lp, 0.0).reshape(target.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):  # type: ignore[override]
        hidden, weight, bias, safe, valid, lse = ctx.saved_tensors
        f64 = torch.float64
        h2 = hidden.reshape(-1, hidden.shape[-1])
        g = torch.where(valid, grad.reshape(-1).to(f64), 0.0) / ctx.temperature
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        dh = torch.zeros(h2.shape, dtype=f64, device=h2.device) if need_h else None
        dw = torch.zeros(weight.shape, dtype=f64, device=weight.device) if need_w else None
        db = torch.zeros(weight.shape[0], dtype=f64, device=weight.device) if need_b and bias is not None else None
        for s, e in _row_blocks(h2.shape[0], weight.shape[0]):
            h = h2[s:e].to(f64)
            for vs, ve, w, dz in _dlogits(h, weight, bias, ctx.temperature, lse[s:e], safe[s:e], g[s:e], valid[s:e]):
                if dh is not None:
                    dh[s:e] += dz @ w
                if dw is not None:
                    dw[vs:ve].addmm_(dz.T, h)
                if db is not None:
                    db[vs:ve] += dz.sum(0)
        return (
            None if dh is None else dh.reshape(hidden.shape).to(hidden.dtype),
            None if dw is None else dw.to(weight.dtype),
            None if db is None else db.to(bias.dtype),
            None,
            None,
            None,
            None,
        )


def dlogit_magnitudes(entry: dict[str, Any], grad: torch.Tensor) -> tuple[float, float]:
    """For a captured reference call and ``grad`` = ∂loss/∂logps: the largest row sum and the
    largest column sum of ``|∂loss/∂logits|`` (block by block, float64), the scales of the hidden
    and the weight gradients' errors (_preference_error)."""
    f64 = torch.float64
    hidden, weight, bias, target = entry["hidden"], entry["weight"], entry["bias"], entry["target"]
    h2 = hidden.detach().reshape(-1, hidden.shape[-1])
    tg = target.reshape(-1)
    valid = tg != entry["ignore_index"]
    safe = torch.where(valid, tg, 0)
    g = torch.where(valid, grad.reshape(-1).to(f64), 0.0) / entry["temperature"]
    row_max = 0.0
    col = torch.zeros(weight.shape[0], dtype=f64, device=weight.device)
    with torch.no_grad():
        for s, e in _row_blocks(h2.shape[0], weight.shape[0]):
            row = torch.zeros(e - s, dtype=f64, device=h2.device)
            for vs, ve, _w, dz in _dlogits(
                h2[s:e].to(f64), weight, bias, entry["temperature"], entry["lse"][s:e], safe[s:e], g[s:e], valid[s:e]
            ):
                dz = dz.abs_()
                row += dz.sum(-1)
                col[vs:ve] += dz.sum(0)
            if e > s:
                row_max = max(row_max, row.max().item())
    return row_max, (col.max().item() if col.numel() else 0.0)


def whole_logits_logps(
    hidden, weight, bias, target, ignore_index: int, temperature: float, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """The same from the whole ``[R, T, V]`` logits in ``dtype``, in plain differentiable ops: the
    path under torch.func transforms (grad, vmap, jvp), which take plain ops and neither a chunked
    walk's in-place writes nor an autograd.Function without functorch rules (the chunked impls'
    too: ``backends/_linear_logps``, in their accumulation dtype)."""
    z = F.linear(hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)) / temperature
    valid = target != ignore_index
    z = torch.where(valid[..., None], z, 0.0)  # ignored tokens: exactly 0 gradient, even from NaN logits
    lp = z.log_softmax(-1).gather(-1, torch.where(valid, target, 0).long().unsqueeze(-1)).squeeze(-1)
    return torch.where(valid, lp, torch.zeros((), dtype=dtype, device=lp.device))
