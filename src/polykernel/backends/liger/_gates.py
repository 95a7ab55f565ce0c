"""Per-call predicates of the Liger impls (torch-free: they read the op's argument class)."""

from __future__ import annotations

from typing import Any

# liger_kernel.ops.utils.calculate_settings: one block holds a whole row, next_power_of_2(n) <= 65536.
MAX_N = 65536


def _row(a: Any) -> str | None:
    n = a.n
    if n is not None and n > MAX_N:
        return f"Liger refuses N > {MAX_N} (one block per row); N = {n}"
    return None


def rms_norm(a: Any) -> str | None:
    return _row(a)


def fused_add_rms_norm(a: Any) -> str | None:
    return _row(a)


def layer_norm(a: Any) -> str | None:
    if a.weight is None or a.bias is None:
        return "Liger's LayerNorm needs both weight and bias"
    return _row(a)


def swiglu(a: Any) -> str | None:
    return _row(a)


def geglu(a: Any) -> str | None:
    if a.approximate != "tanh":
        return "Liger's GeGLU is the tanh approximation only"
    return _row(a)


def softmax(a: Any) -> str | None:
    return _row(a)  # liger_kernel/ops/softmax.py calls calculate_settings(n) before its multi-block path


def moe_experts(a: Any) -> str | None:
    # LigerFusedMoEFunction: SwiGLU experts (its kernels hard-code silu); its backward returns the
    # routing-weight gradient in hidden's dtype and sums it in that dtype's buffer
    if a.activation != "silu":
        return f"Liger's fused MoE is SwiGLU only (activation='silu'), not {a.activation!r}"
    if a.weights_dtype is not None and a.weights_dtype != a.dtype:
        return "Liger's fused MoE takes routing weights of hidden's dtype only"
    return None
