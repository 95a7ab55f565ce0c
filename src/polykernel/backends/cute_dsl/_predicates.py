"""Per-call predicates of the cute_dsl softmax and cross-entropy impls (torch- and cutlass-free:
they read the op's argument class, so ``explain`` can give the reason on any machine)."""

from __future__ import annotations

from typing import Any

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
SOFTMAX_MAX_N = 32768  # one CTA holds the row in registers (32 fp32 a thread at 1024 threads)
CE_MAX_V = 1 << 20  # rows are walked in chunks; bounded only to keep column indices in int32


def _vec(dtype: Any) -> int:
    return 16 // _BYTES.get(str(dtype).removeprefix("torch."), 4)


def softmax(a: Any) -> str | None:
    vec, n = _vec(a.dtype), a.n
    if n is None:
        return None
    if n == 0 or n % vec:
        return f"cute_dsl softmax needs N a positive multiple of {vec} (16-byte vectors); N = {n}"
    if n > SOFTMAX_MAX_N:
        return f"cute_dsl softmax holds a row in registers: N <= {SOFTMAX_MAX_N}; N = {n}"
    return None


def cross_entropy(a: Any) -> str | None:
    vec, v = _vec(a.dtype), a.n_classes
    if v is None:
        return None
    if v % vec:
        return f"cute_dsl cross_entropy needs V a multiple of {vec} (16-byte vectors); V = {v}"
    if v > CE_MAX_V:
        return f"cute_dsl cross_entropy: V <= {CE_MAX_V}; V = {v}"
    return None
