"""PyTorch MoE experts: the token-expert pairs sorted by expert once, then per-expert GEMMs.

The GEMMs over the sorted pairs run one of two ways, chosen per call:

- ``torch._grouped_mm`` (one launch per projection, offsets on the device: no host sync) where it
  runs: probed once per device and dtype (:func:`grouped_mm_refusal` says why not: a torch
  without it, float64, H or I not a multiple of 16 bytes, deterministic mode, a probe that
  raised);
- else one ``F.linear`` per non-empty expert, which reads the group offsets on the host (one sync
  per call). Under CUDA-graph capture, where a sync is impossible, the call runs the reference
  (every expert on all tokens, masked: E/k times the work, but graph-safe), as it does for meta
  tensors, tensor subclasses and under functorch transforms.

Then ``act(gate)·up`` in fp32 (rounded to the dtype for the down GEMM), the down GEMM, the
routing weights and the sum over each token's k pairs in fp32 (a gather back to token order and a
sum: no atomics), one rounding at the end. autograd differentiates it all.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ... import _compat
from ...ops.moe_experts import activate, reference
from .. import _moe_route as route

_transforms_active = _compat.functorch_transforms_active
_PLAIN = (torch.Tensor, torch.nn.Parameter)


_probed: dict[tuple[torch.device, torch.dtype], str | None] = {}


def _probe(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when ``torch._grouped_mm`` runs forward and backward here, else why not (once per
    device and dtype)."""
    key = (device, dtype)
    if key not in _probed:
        try:
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
    y = experts(x, lambda a, weight: gemm(a, weight, offsets), perm, acc)
    weighted = y * top_k_weights.reshape(-1).index_select(0, perm).to(acc)[:, None]
    out = weighted.index_select(0, route.inverse(perm)).view(t, k, h).sum(1)  # back to token order, Σ over k
    return out.to(hidden.dtype)


def moe_experts(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    activation: str,
) -> torch.Tensor:
    """The registered impl (arguments already validated by ``polykernel.moe_experts``)."""
    args = (hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, activation)
    if not plain(args[:5]):
        return reference(*args)
    why = grouped_mm_refusal(hidden, gate_up_proj, down_proj)
    if why is not None and capturing(hidden):  # the loop's host sync is impossible
        return reference(*args)

    def experts(x: torch.Tensor, gemm: Callable, perm: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
        gate, up = gemm(x, gate_up_proj).to(acc).chunk(2, dim=-1)
        inner = (activate(gate, activation) * up).to(hidden.dtype)
        return gemm(inner, down_proj).to(acc)

    return sorted_experts(hidden, top_k_index, top_k_weights, gate_up_proj.shape[0], why is None, experts)
