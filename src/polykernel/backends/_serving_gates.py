"""Predicates the serving peers (FlashInfer, sgl-kernel) share, torch-free: both run FlashInfer's
norm kernels (``flashinfer/norm.cuh``; sgl-kernel compiles them in), so where they compute
something else than polykernel's norms is one fact, stated once here.
"""

from __future__ import annotations

from typing import Any

# FusedAddRMSNorm stages the row's fp32 sum in shared memory: (32 + N)·4 bytes per block, and
# sm_90 gives a block at most 232448 bytes.
SMEM_BYTES = 232448
MAX_FUSED_N = SMEM_BYTES // 4 - 32

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

HALF = ("torch.bfloat16", "bfloat16")  # the dtype the peers' measured ranks were measured in (an argument class's dtype, or its name)

# The CUDA norm kernels address rows in uint32; the adapters split a tensor of more than 2**32
# elements into slices of 16-row multiples (backends/_dense.py, uint32_parts), which needs
# 16·N <= 2**32 (kept in step with _dense.MAX_PART_N; this module stays torch-free).
MAX_ROW_N = (1 << 32) // 16


def long_rows(peer: str, a: Any) -> str | None:
    """Rows too long for the uint32 row slicing (N > 2**28): see MAX_ROW_N."""
    if a.n is not None and a.n > MAX_ROW_N:
        return f"{peer}'s norm kernels address rows in uint32: N <= {MAX_ROW_N} (16 rows within 2**32 elements), got {a.n}"
    return None


def norm(peer: str, a: Any) -> str | None:
    """rms_norm / fused_add_rms_norm_ arguments the peer's kernels compute as the op does."""
    if getattr(a, "casting", "fp32") != "fp32":
        return f"{peer} normalises in fp32 and rounds once (casting='fp32' only)"
    if a.offset not in (0.0, 1.0):
        return f"{peer} has weight + 0 (rmsnorm) and weight + 1 (gemma_rmsnorm) only, not offset={a.offset}"
    if a.weight_dtype != a.dtype:
        return f"{peer} reads the weight as x's dtype: needs weight in {a.dtype}, got {a.weight_dtype}"
    return long_rows(peer, a)


def fused_norm(peer: str, a: Any) -> str | None:
    reason = norm(peer, a)
    if reason is None and a.n is not None and a.n > MAX_FUSED_N:
        return f"{peer}'s fused add + RMSNorm stages the row in shared memory: N <= {MAX_FUSED_N}, got {a.n}"
    return reason


def gelu_and_mul(peer: str, a: Any) -> str | None:
    """gelu_and_mul: the erf form only. Both peers' tanh kernels use the hardware's approximate
    tanh (``tanh.approx.f32``, ~2^-11 relative): where gelu's ``1 + tanh`` cancels (a negative
    gate) that is an absolute error of ~2^-12·|gate·up|, 1.4-1.6x the op's error model on an H100
    (bf16 and fp16, 64 and 8192 x 28672; benchmarks/results/h100-2026-12-06-twentieth/)."""
    if a.approximate == "tanh":
        return f"{peer}'s gelu_tanh_and_mul uses the approximate hardware tanh (tanh.approx.f32): outside the op's error model"
    return and_mul(peer, a)


def and_mul(peer: str, a: Any) -> str | None:
    """silu_and_mul / gelu_and_mul: both peers' kernels load x's halves and write out's rows 16
    bytes at a time, from ``x + row·2d`` and ``x + row·2d + d``, so each half row, d elements, must
    be a multiple of 16 bytes (not only 2d: at 5 x 1000 in bf16, d = 500 is 1000 bytes, and
    sgl-kernel's silu_and_mul faulted with a misaligned address on the H200, 2026-12-04,
    benchmarks/results/h200-2026-12-04-serving/; a CUDA fault poisons the process). FlashInfer's
    wrapper checks only 2d ("The pointers must be multiple of 16 bytes."), sgl-kernel's registered
    ops nothing."""
    width = _BYTES.get(str(a.dtype).removeprefix("torch."), 4)
    if a.n is not None and (a.n % 2 or (a.n // 2) * width % 16):
        return f"{peer}'s activations need each half of x's rows in multiples of 16 bytes: d = {a.n / 2:g} in {str(a.dtype).removeprefix('torch.')}"
    return None
