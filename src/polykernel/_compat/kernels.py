"""The private APIs that kernels and their launchers use (CUDA, Triton, the MoE ops), probed as the
rest of :mod:`polykernel._compat`, which re-exports these names (see its table)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch

from .probe import _probe

# -- CUDA ----------------------------------------------------------------------------------------

_BUSY_N = 2048  # the fallback's matmul: 2·2048³ flop, ~0.05-0.3 ms on a recent GPU, >> its launch
_busy: dict[int, tuple[torch.Tensor, torch.Tensor, float]] = {}  # device -> (a, out, ms per matmul)


def _clock_khz(device: int) -> float:
    khz = getattr(torch.cuda.get_device_properties(device), "clock_rate", 0)
    return float(khz) if khz else 2.0e6  # unknown: a ~2 GHz GPU


def _busy_matmuls(cycles: int) -> None:
    """Keep the current stream busy for about ``cycles`` GPU cycles, as ``torch.cuda._sleep`` does:
    back-to-back matmuls on a small buffer, each far longer on the GPU than its launch on the host,
    so the queue fills ahead of the host. The time per matmul is measured once per device."""
    device = torch.cuda.current_device()
    state = _busy.get(device)
    if state is None:
        a = torch.randn(_BUSY_N, _BUSY_N, device="cuda")
        out = torch.empty_like(a)
        torch.mm(a, a, out=out)  # warm-up (cuBLAS handle, workspace)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            torch.mm(a, a, out=out)
        end.record()
        end.synchronize()
        state = _busy[device] = (a, out, max(start.elapsed_time(end) / 5, 1e-3))
    a, out, per_ms = state
    for _ in range(max(1, math.ceil(cycles / _clock_khz(device) / per_ms))):
        torch.mm(a, a, out=out)


cuda_sleep: Callable[[int], None] = _probe("cuda_sleep", lambda: getattr(torch.cuda, "_sleep", None), _busy_matmuls)


def _public_raw_stream(device: int) -> int:
    return torch.cuda.current_stream(device).cuda_stream


# The current CUDA device and raw stream as Triton's launcher takes them (the C functions skip a
# frame and a Stream object); None on a CPU-only build, which launches no CUDA kernel.
_cuda_built = torch.backends.cuda.is_built()
cuda_current_device: Callable[[], int] | None = (
    _probe("cuda_current_device", lambda: getattr(torch._C, "_cuda_getDevice", None), torch.cuda.current_device) if _cuda_built else None
)
cuda_raw_stream: Callable[[int], int] | None = (
    _probe("cuda_raw_stream", lambda: getattr(torch._C, "_cuda_getCurrentRawStream", None), _public_raw_stream) if _cuda_built else None
)


# -- Triton (probed when the Triton backend loads: importing triton here would cost every user) ---


@functools.cache
def triton_jit_function() -> type | None:
    """Triton's ``JITFunction`` class, whose cached compiled kernels the fast launch path calls
    directly (its ``run``, ``function``, ``packed_metadata``, ``used_global_vals``, ``params``:
    each read under a try that turns the path off for the kernel). None: the path is off."""

    def get() -> Any:
        import triton

        return triton.runtime.jit.JITFunction

    return _probe("triton_jit_function", get, None)


@functools.cache
def triton_runtime_knobs() -> Any:
    """``triton.knobs.runtime``: where the launch hooks (profilers) are set, which only run on
    Triton's own launch path. None: hooks cannot be seen, so the fast and native paths are off."""

    def get() -> Any:
        import triton

        return triton.knobs.runtime

    return _probe("triton_runtime_knobs", get, None)


# -- mixture of experts (polykernel.backends._moe_route, ._moe_experts) ---------------------


def _assert_on_host(cond: torch.Tensor, message: str) -> None:
    if not bool(cond):  # reads the value: a host sync, impossible under CUDA-graph capture
        raise RuntimeError(message)


# Fails the stream unless ``cond`` (a one-element tensor) is nonzero, without a host sync: the MoE
# impls' check of the expert indices off the CPU. Fallback: the same check on the host.
assert_async: Callable[[torch.Tensor, str], None] = _probe("assert_async", lambda: torch._assert_async, _assert_on_host)

# One GEMM per group of rows (the MoE experts' projections); None: the torch impl loops over the
# experts (where it exists, the impl still probes it per device and dtype before use).
grouped_mm: Callable[..., torch.Tensor] | None = _probe("grouped_mm", lambda: getattr(torch, "_grouped_mm", None), None)
