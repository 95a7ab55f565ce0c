"""Per-call predicates of the sgl-kernel impls (torch-free: they read the op's argument class)."""

from __future__ import annotations

from typing import Any

from .. import _serving_gates as shared


def rms_norm(a: Any) -> str | None:
    return shared.norm("sgl-kernel", a)


def fused_add_rms_norm_(a: Any) -> str | None:
    return shared.fused_norm("sgl-kernel", a)


def silu_and_mul(a: Any) -> str | None:
    return shared.and_mul("sgl-kernel", a)


def gelu_and_mul(a: Any) -> str | None:
    return shared.gelu_and_mul("sgl-kernel", a)


def rotary_embedding_(a: Any) -> str | None:
    # csrc/elementwise/pos_enc.cu (a copy of an older vLLM kernel; vLLM's own now computes in
    # fp32): x·cos - y·sin in the tensors' own dtype, each product rounded to it; the op computes
    # in fp32 and rounds once
    if str(a.dtype).removeprefix("torch.") != "float32":
        return f"sgl-kernel's rotary_embedding computes in the tensors' dtype (each product rounded): float32 only, got {str(a.dtype).removeprefix('torch.')}"
    return None
