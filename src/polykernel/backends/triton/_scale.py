"""The loss backwards' cotangent multiply under CUDA-graph capture, reading the cotangent on the device.

The losses compute their gradients for ``grad_output = 1`` and multiply by the real ``g`` in
backward (:func:`polykernel.backends._cross_entropy.scale_grads_`). Eagerly, ``g`` is read on
the host: the multiply is skipped when ``g == 1`` and otherwise takes a host number, computed in
fp32. Under capture ``g`` stays a 0-d device tensor, and torch's ``t.mul_(g)`` then (1) casts ``g``
to a bf16 gradient's dtype first (the graph's gradients differed from eager's by that rounding)
and (2) takes TensorIterator's non-vectorized broadcast path (the fused linear CE's 1 GiB bf16
grad_weight: this kernel is 4x faster in a graph, notes/PERF.md "Fused linear cross-entropy: why
the graph was slower"). It multiplies in fp32
by ``g`` as stored, one read and one write, so a graph's gradients equal eager's bit for bit.

Example::

    scale_grads_(g, grad_hidden, grad_weight, None)   # in place; None entries skipped
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._cross_entropy import scale_grads_ as _host_scale_grads_
from ._launch import launch
from ._rows import cdiv as _cdiv

BLOCK = 4096  # elements per program: 32 per thread on 4 warps
_TAKES = (torch.bfloat16, torch.float16, torch.float32)  # fp32 math is exact torch semantics for these


@triton.jit
def _scale_kernel(X, G, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    g = tl.load(G).to(tl.float32)
    x = tl.load(X + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(X + offs, (x * g).to(X.dtype.element_ty), mask=ok)


def scale_on_device_(t: torch.Tensor, g: torch.Tensor) -> None:
    """``t *= g`` in place for a contiguous ``t`` (bf16, fp16 or fp32) and a 1-element ``g`` on
    its device, computed as torch computes ``t.mul_(g.item())``: fp32 product, one rounding."""
    n = t.numel()
    if n:
        launch(_scale_kernel, (_cdiv(n, BLOCK),), t, g, n, BLOCK=BLOCK, num_warps=4)


def scale_grads_(g: torch.Tensor, *grads: torch.Tensor | None) -> None:
    """The Triton impls' ``scale_grads_``: the torch one, except under capture, where a 1-element
    ``g`` scales each contiguous bf16/fp16/fp32 gradient through :func:`scale_on_device_`."""
    capturing = g.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if not capturing or g.numel() != 1:
        _host_scale_grads_(g, *grads)
        return
    for t in grads:
        if t is None:
            continue
        if t.dtype in _TAKES and t.is_contiguous() and t.device == g.device:
            scale_on_device_(t, g)
        else:
            t.mul_(g)
