"""MoE experts' shared machinery (the torch impl's, gpt-oss's and triton's gates): the pairs sorted by
expert, per-expert GEMMs through ``torch._grouped_mm`` where it runs (:func:`grouped_mm_refusal`),
else one ``F.linear`` per expert. Here, not in ``backends/torch``, so that no backend imports another (issue 36)."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .. import _compat
from ..ops import _autocast
from . import _moe_route as route

_transforms_active = _compat.functorch_transforms_active
_PLAIN = (torch.Tensor, torch.nn.Parameter)


_probed: dict[tuple[torch.device, torch.dtype], str | None] = {}


def _probe(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when ``torch._grouped_mm`` runs forward and backward here, else why not (once per
    device and dtype, whatever the caller's grad mode: a first call under no_grad or
    inference_mode must not record a failure for good)."""
    key = (device, dtype)
    if key not in _probed:
        try:
            with torch.inference_mode(False), torch.enable_grad():
                x = torch.randn(8, 16, device=device, dtype=dtype, requires_grad=True)
                w = torch.randn(2, 16, 8, device=device, dtype=dtype, requires_grad=True)
                y = _compat.grouped_mm(x, w, offs=torch.tensor([3, 8], device=device, dtype=torch.int32))
                torch.autograd.grad(y, (x, w), torch.randn_like(y))
            _probed[key] = None
        except Exception as exc:  # no kernel for this device or dtype (CPU before torch 2.9, fp16 ...)
            first = str(exc).splitlines()[0][:120] if str(exc) else ""
            _probed[key] = f"torch._grouped_mm failed its probe on {device.type} {dtype}: {type(exc).__name__}: {first}"
    return _probed[key]


def capturing(t: torch.Tensor) -> bool:
    """Whether a CUDA graph is being captured on ``t``'s device (no host sync possible)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def grouped_mm_refusal(hidden: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> str | None:
    """Why this call's GEMMs cannot use ``torch._grouped_mm`` (None: they do)."""
    return refusal(hidden, down_proj.shape[2], gate_up_proj, down_proj)


def refusal(hidden: torch.Tensor, inter: int, gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> str | None:
    """``grouped_mm_refusal`` for projections of any layout, given I (shared with gpt-oss's)."""
    if _compat.grouped_mm is None:
        return f"no torch._grouped_mm here ({_compat.fallbacks().get('grouped_mm', 'missing')})"
    if hidden.dtype == torch.float64:
        return "torch._grouped_mm takes fp32/bf16/fp16 only"
    if torch.are_deterministic_algorithms_enabled():
        return "deterministic mode: torch._grouped_mm makes no determinism promise"
    elt = hidden.element_size()
    if (hidden.shape[1] * elt) % 16 or (inter * elt) % 16:
        return "torch._grouped_mm needs H and I to be multiples of 16 bytes (its strides)"
    if not (gate_up_proj.is_contiguous() and down_proj.is_contiguous()) or (gate_up_proj.data_ptr() | down_proj.data_ptr()) % 16:
        return "torch._grouped_mm needs contiguous, 16-byte aligned projections"
    if capturing(hidden) and (hidden.device, hidden.dtype) not in _probed:
        return "not probed yet, and no probe may run during CUDA-graph capture"
    return _probe(hidden.device, hidden.dtype)


def _grouped(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``x[rows of e] @ weight[e].T`` for each expert's rows, through ``torch._grouped_mm``."""
    return _compat.grouped_mm(x, weight.transpose(-2, -1), offs=offsets[1:].to(torch.int32))


def _looped(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The same, one ``F.linear`` per non-empty expert (the group bounds read on the host)."""
    bounds = offsets.tolist()
    parts = [F.linear(x[a:b], weight[e]) for e, (a, b) in enumerate(itertools.pairwise(bounds)) if b > a]
    return torch.cat(parts) if parts else F.linear(x, weight[0])  # no pairs: an empty product, in the graph


def plain(tensors: tuple[torch.Tensor, ...]) -> bool:
    """Whether the sorted path may take these arguments. Not under functorch transforms, not for
    meta tensors (no values to sort), nor tensor subclasses, whose values a host read (the loop's
    offsets) may not reach: the reference's plain torch ops take them all."""
    return not (_transforms_active() or tensors[0].is_meta or not all(type(a) in _PLAIN for a in tensors))


def sorted_experts(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    n_experts: int,
    grouped: bool,
    experts: Callable[[torch.Tensor, Callable[[torch.Tensor, torch.Tensor], torch.Tensor], torch.Tensor, torch.dtype], torch.Tensor],
    op_id: str = route.OP_ID,
) -> torch.Tensor:
    """The skeleton: the pairs sorted by expert, their rows of hidden gathered (``x [S, H]``),
    ``experts(x, gemm, perm, acc)`` -> each pair's unweighted output ``[S, H]`` in the fp32 (or
    fp64) ``acc``, with ``gemm(a, weight)`` = ``a[rows of e] @ weight[e].T`` per expert (grouped
    or looped); then the routing weights and the sum over each token's k pairs (a gather back to
    token order and a sum: no atomics), one rounding at the end."""
    gemm = _grouped if grouped else _looped
    t, h = hidden.shape
    k = top_k_index.shape[1]
    perm, offsets = route.sort_by_expert(top_k_index, n_experts, op_id=op_id)
    x = hidden.index_select(0, perm // k)  # [S, H], pairs by expert
    if grouped:
        x = x.contiguous()
    acc = torch.promote_types(torch.promote_types(hidden.dtype, top_k_weights.dtype), torch.float32)
    if _autocast.enabled(hidden.device.type):  # the op's math in its dtypes: autocast would lower F.linear's loop, not _grouped_mm
        with _autocast.off(hidden.device.type):
            y = experts(x, lambda a, weight: gemm(a, weight, offsets), perm, acc)
    else:
        y = experts(x, lambda a, weight: gemm(a, weight, offsets), perm, acc)
    weighted = y * top_k_weights.reshape(-1).index_select(0, perm).to(acc)[:, None]
    out = weighted.index_select(0, route.inverse(perm)).view(t, k, h).sum(1)  # back to token order, Σ over k
    return out.to(hidden.dtype)
