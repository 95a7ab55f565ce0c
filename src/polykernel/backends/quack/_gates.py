"""Per-call predicates of the QuACK impls (torch-free: they read the op's argument class)."""

from __future__ import annotations

from typing import Any

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _bytes(dtype: Any) -> int:
    return _BYTES.get(str(dtype).removeprefix("torch."), 4)


def _vectors(a: Any) -> str | None:
    # H200, 2026-11-30 (benchmarks/check_peers.py): N = 1, 7, 33 and 70001 in bf16/fp16 fail to
    # compile ("could not build valid IR"): QuACK's row kernels load 16 bytes at a time
    vec, n = 16 // _bytes(a.dtype), getattr(a, "n", None) or getattr(a, "n_classes", None)
    if n is not None and n % vec:
        return f"QuACK needs N divisible by {vec} (16-byte loads); N = {n}"
    return None


def rms_norm(a: Any) -> str | None:
    if _vectors(a):
        return _vectors(a)
    if a.casting != "fp32":
        return "QuACK has casting='fp32' only (x̂ and the weight multiply in fp32, one cast)"
    # quack/rmsnorm.py RMSNormBackward: "does not support N > 128k with dtype >= 32 bits" (smem)
    if a.needs_grad and _bytes(a.dtype) >= 4 and a.n is not None and a.n > 128 * 1024:
        return f"QuACK's RMSNorm backward refuses N > 131072 in fp32 (shared memory); N = {a.n}"
    return None


def fused_add_rms_norm(a: Any) -> str | None:
    if _vectors(a):
        return _vectors(a)
    if a.needs_grad and _bytes(a.dtype) >= 4 and a.n is not None and a.n > 128 * 1024:
        return f"QuACK's RMSNorm backward refuses N > 131072 in fp32 (shared memory); N = {a.n}"
    return None


def cross_entropy(a: Any) -> str | None:
    if _vectors(a):  # V = 1, 3001, 4999 failed to compile in bf16/fp16 on the H200
        return _vectors(a)
    if a.label_smoothing:
        return "QuACK's cross-entropy has no label_smoothing"
    return None
