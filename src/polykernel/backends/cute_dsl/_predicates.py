"""Per-call predicates and measured rank rules of the cute_dsl softmax and cross-entropy impls
(torch- and cutlass-free: they read the op's argument class, so ``explain`` can give the reason on
any machine).

The rank rules (``KernelSpec.rank_for``) put our kernel ahead of Triton (rank 10) where the H200
measured it faster, and nowhere else (``benchmarks/kernels/bench_cute_dsl.py``, bf16, CUDA-graph replays:
``benchmarks/results/h200-2026-11-30-cute-dsl.json``; each rule's reason gives its figures). Only
bf16 was measured; fp16 moves the same bytes, so the rules cover both, and fp32 (unmeasured) keeps
the static rank (behind Triton).
"""

from __future__ import annotations

from typing import Any

from ._gates import VEC_BYTES, elem_bytes

SOFTMAX_MAX_N = 32768  # one CTA holds the row in registers (32 fp32 a thread at 1024 threads)
CE_MAX_V = 1 << 20  # rows are walked in chunks; bounded only to keep column indices in int32
PREFERRED_RANK = 5  # ahead of triton's 10
SOFTMAX_PREFER_N = 16384
CE_PREFER_V = 32768


def _half(dtype: Any) -> bool:
    return elem_bytes(dtype) == 2


def _vec(dtype: Any) -> int:
    return VEC_BYTES // (elem_bytes(dtype) or 4)


def _row_length(op: str, what: str, dtype: Any, n: int | None, limit: int, why: str) -> str | None:
    """Refuse a row length that 16-byte vectors do not tile (no scalar tail), or past ``limit``."""
    if n is None:  # no argument class yet: decided per call
        return None
    vec = _vec(dtype)
    if n == 0 or n % vec:
        return f"cute_dsl {op} needs {what} a positive multiple of {vec} (16-byte vectors); {what} = {n}"
    if n > limit:
        return f"cute_dsl {op}{why}: {what} <= {limit}; {what} = {n}"
    return None


def softmax(a: Any) -> str | None:
    return _row_length("softmax", "N", a.dtype, a.n, SOFTMAX_MAX_N, " holds a row in registers")


def cross_entropy(a: Any) -> str | None:
    if getattr(a, "has_weight", False) or getattr(a, "softcap", None) is not None or getattr(a, "z_loss", 0.0):
        return "cute_dsl cross_entropy has no class weights, softcap or z_loss (triton and torch have them)"
    return _row_length("cross_entropy", "V", a.dtype, a.n_classes, CE_MAX_V, "")


def softmax_rank(a: Any) -> tuple[int, str] | None:
    """Preferred for long 16-bit rows, N >= 16384 (and the predicate's N <= 32768).

    Measured faster at N = 32768 only; at N = 4096 Triton wins, so short rows keep the static
    rank. The 16384 threshold between the two points is a guess.

    >>> from types import SimpleNamespace as A
    >>> softmax_rank(A(dtype="bfloat16", n=32768))[0], softmax_rank(A(dtype="bfloat16", n=4096))
    (5, None)
    >>> softmax_rank(A(dtype="float32", n=32768)) is None
    True
    """
    n = getattr(a, "n", None)
    if n is None or n < SOFTMAX_PREFER_N or not _half(a.dtype) or softmax(a) is not None:
        return None
    return PREFERRED_RANK, (
        f"N >= {SOFTMAX_PREFER_N}: measured at N = 32768 only (H200 bf16, 8192x32768): fwd 3.41 vs triton 3.23 TB/s, "
        "fwd+bwd 3.63 vs 3.53; triton wins at N = 4096"
    )


def cross_entropy_rank(a: Any) -> tuple[int, str] | None:
    """Preferred for large vocabularies of 16-bit logits, V >= 32768.

    Measured faster (than Triton and QuACK) at V = 128256 only; smaller V is unmeasured: static
    rank (behind Triton).

    >>> from types import SimpleNamespace as A
    >>> cross_entropy_rank(A(dtype="bfloat16", n_classes=128256))[0], cross_entropy_rank(A(dtype="bfloat16", n_classes=4096))
    (5, None)
    """
    v = getattr(a, "n_classes", None)
    if v is None or v < CE_PREFER_V or not _half(a.dtype) or cross_entropy(a) is not None:
        return None
    return PREFERRED_RANK, (
        f"V >= {CE_PREFER_V}: measured at V = 128256 only (H200 bf16, 8192 rows): fwd 0.487 ms vs triton 0.595, fwd+bwd 1.512 vs 1.613"
    )
