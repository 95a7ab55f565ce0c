"""Per-call predicates of the FlashInfer impls (torch-free: they read the op's argument class)."""

from __future__ import annotations

from typing import Any

from .. import _serving_gates as shared

_ROPE_HEADS = (64, 128, 256, 512)  # BatchQKApplyRotaryPosIdsCosSinCache's compiled head sizes


def rms_norm(a: Any) -> str | None:
    return shared.norm("FlashInfer", a)


def fused_add_rms_norm_(a: Any) -> str | None:
    return shared.fused_norm("FlashInfer", a)


def silu_and_mul(a: Any) -> str | None:
    return shared.and_mul("FlashInfer", a)


def gelu_and_mul(a: Any) -> str | None:
    return shared.and_mul("FlashInfer", a)


def rotary_embedding_(a: Any) -> str | None:
    if not a.has_key:
        return "FlashInfer's apply_rope_with_cos_sin_cache_inplace needs a key"
    if a.head_size not in _ROPE_HEADS:
        return f"FlashInfer's cos/sin-cache rope kernel has head sizes {_ROPE_HEADS}, got {a.head_size}"
    # each thread rotates vectors of max(8, head_size / 32) features: rotary_dim a multiple of two
    step = max(16, a.head_size // 16)
    if a.rotary_dim % step:
        return f"FlashInfer rotates whole vectors: rotary_dim a multiple of {step} at head_size {a.head_size}, got {a.rotary_dim}"
    return None


def rms_norm_quant_fp8(a: Any) -> str | None:
    if a.per_row:
        return "FlashInfer's rmsnorm_quant takes one scale per tensor, not one per row"
    if a.weight_dtype != a.dtype:
        return f"FlashInfer reads the weight as x's dtype: needs weight in {a.dtype}, got {a.weight_dtype}"
    return None
