"""What the chunked loss drivers hand cuBLAS: every matmul's operands and result, recorded, the
check that none of them has a class count (or a row stride) off 16 bytes
(``polykernel.core.aligned_head``), and a walk's results with the head padded and without."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_MATMULS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.mm.out,
    torch.ops.aten.addmm.default,
    torch.ops.aten.addmm.out,
    torch.ops.aten.addmm_.default,
}
# torch.mm(..., out_dtype=) (CUDA, torch >= 2.8): the fused linear JSD's fp32 logits of 16-bit heads
if hasattr(torch.ops.aten.mm, "dtype"):
    _MATMULS.add(torch.ops.aten.mm.dtype)


class Matmuls(TorchDispatchMode):
    """Records ``[(shape, strides), ...]`` of each matmul's tensors (operands, then the result)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[list[tuple[tuple[int, ...], tuple[int, ...]]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _MATMULS:
            tensors = [t for t in (*args, *(kwargs or {}).values(), out) if isinstance(t, torch.Tensor)]
            self.calls.append([(tuple(t.shape), t.stride()) for t in tensors])
        return out


def assert_padded(calls: list, v: int, per: int) -> None:
    """Every recorded matmul sees ``v`` classes as ``v`` rounded up to ``per`` (sizes and strides)."""
    vp = v + (-v % per)
    assert calls, "no matmul recorded"
    for call in calls:
        dims = {d for shape, _ in call for d in shape} | {abs(s) for _, strides in call for s in strides}
        assert v not in dims and vp in dims, (v, vp, call)


def padded_then_plain(monkeypatch, driver, run: Callable[[], Any]) -> tuple[Any, Any]:
    """``run()`` with ``driver``'s head padded, then again on the head as it is (its
    ``aligned_head`` made the identity)."""
    padded = run()
    monkeypatch.setattr(driver, "aligned_head", lambda weight, bias, element_size: (weight, bias))
    return padded, run()


def assert_same(got, want, rtol: float, atol: float) -> None:
    """Pairwise equal within tolerance, of the same shapes and contiguous, NaNs in the same places."""
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and a.is_contiguous() and torch.equal(a.isnan(), b.isnan())
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, equal_nan=True)
