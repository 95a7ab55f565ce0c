"""Per-call predicates of the QuACK impls (torch-free: they read the op's argument class)."""

from __future__ import annotations

from typing import Any

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _bytes(dtype: Any) -> int:
    return _BYTES.get(str(dtype).removeprefix("torch."), 4)


def rms_norm(a: Any) -> str | None:
    if a.casting != "fp32":
        return "QuACK has casting='fp32' only (x̂ and the weight multiply in fp32, one cast)"
    # quack/rmsnorm.py RMSNormBackward: "does not support N > 128k with dtype >= 32 bits" (smem)
    if a.needs_grad and _bytes(a.dtype) >= 4 and a.n is not None and a.n > 128 * 1024:
        return f"QuACK's RMSNorm backward refuses N > 131072 in fp32 (shared memory); N = {a.n}"
    return None


def fused_add_rms_norm(a: Any) -> str | None:
    if a.needs_grad and _bytes(a.dtype) >= 4 and a.n is not None and a.n > 128 * 1024:
        return f"QuACK's RMSNorm backward refuses N > 131072 in fp32 (shared memory); N = {a.n}"
    return None


def softmax(a: Any) -> str | None:
    # quack/softmax.py: vecsize = 128 // dtype width, and ReductionBase asserts N % vecsize == 0
    vec = 16 // _bytes(a.dtype)
    if a.n is not None and a.n % vec:
        return f"QuACK's softmax needs N divisible by {vec} (16-byte loads); N = {a.n}"
    return None


def cross_entropy(a: Any) -> str | None:
    if a.label_smoothing:
        return "QuACK's cross-entropy has no label_smoothing"
    return None
