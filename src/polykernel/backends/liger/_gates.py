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


def sparsemax(a: Any) -> str | None:
    return _row(a)  # liger_kernel/ops/sparsemax.py: calculate_settings(n_cols), one block per row


def group_norm(a: Any) -> str | None:
    if a.weight is None or a.bias is None:
        return "Liger's GroupNorm needs both weight and bias"
    if a.weight[0] != a.dtype or a.bias[0] != a.dtype:
        return "Liger's GroupNorm takes weight and bias in x's dtype"  # its dW/dB buffers and atomics
    return None


def dyt(a: Any) -> str | None:
    # liger_kernel/ops/dyt.py casts dalpha and dbias to x's dtype (then autograd to the parameters')
    if any(p is not None and p[0] != a.dtype for p in (a.alpha, a.weight, a.bias)):
        return "Liger's DyT takes alpha, weight and bias in x's dtype"
    return None


def poly_norm(a: Any) -> str | None:
    # liger_kernel/ops/poly_norm.py casts dbias to weight's dtype (then autograd to bias's)
    if a.weight[0] != a.dtype or a.bias[0] != a.dtype:
        return "Liger's PolyNorm takes weight and bias in x's dtype"
    return _row(a)
