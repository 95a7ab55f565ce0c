"""Per-call predicates of the ``cute_dsl`` impls (torch- and CuTeDSL-free: they read the op's
argument class, so an op file can import them on a machine without ``cutlass``).

Device, arch (sm_90+) and the ``cutlass`` / ``tvm_ffi`` modules are gated by the backend's
declaration (``CUTE_DSL`` in this package's ``__init__``); these predicates say which argument
classes our kernels take.
"""

from __future__ import annotations

from typing import Any

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
VEC_BYTES = 16  # every row kernel moves 128-bit vectors
MAX_NORM_N = 262144  # cluster of 16 CTAs x 512 threads x 32 elements (see _common.row_config)


def elem_bytes(dtype: Any) -> int | None:
    """Bytes per element of a supported dtype (``torch.bfloat16`` or ``"bfloat16"``), else None."""
    return _BYTES.get(str(dtype).removeprefix("torch."))


def vectors(op: str, dtype: Any, n: int | None, what: str = "N") -> str | None:
    """Refuse a row length that 16-byte vectors do not tile (the kernels have no scalar tail)."""
    size = elem_bytes(dtype)
    if size is None:
        return f"cute_dsl {op} takes float32/bfloat16/float16, got {dtype}"
    vec = VEC_BYTES // size
    if n is not None and n % vec:
        return f"cute_dsl {op} needs {what} divisible by {vec} (16-byte vectors); {what} = {n}"
    return None


def _param_dtype(op: str, name: str, dtype: Any) -> str | None:
    if dtype is not None and elem_bytes(dtype) is None:
        return f"cute_dsl {op} takes float32/bfloat16/float16 {name}, got {dtype}"
    return None


def _norm_row(op: str, a: Any) -> str | None:
    reason = vectors(op, a.dtype, a.n)
    if reason:
        return reason
    if a.n is not None and a.n > MAX_NORM_N:
        return f"cute_dsl {op} holds a row in one cluster: N <= {MAX_NORM_N}; N = {a.n}"
    return None


def rms_norm(a: Any) -> str | None:
    """``norm.rms_norm``: 16-byte rows up to 256K, both castings, any offset and weight dtype."""
    return _norm_row("rms_norm", a) or _param_dtype("rms_norm", "weight", a.weight_dtype)


def layer_norm(a: Any) -> str | None:
    """``norm.layer_norm``: 16-byte rows up to 256K, weight and bias each optional."""
    return (
        _norm_row("layer_norm", a)
        or _param_dtype("layer_norm", "weight", a.weight_dtype)
        or _param_dtype("layer_norm", "bias", a.bias_dtype)
    )


_HALF = ("torch.bfloat16", "torch.float16", "bfloat16", "float16")


def layer_norm_rank(a: Any) -> tuple[int, str] | None:
    """Measured rule (KernelSpec.rank_for): our CuTeDSL layer_norm first where it beat Triton.

    Where it won (benchmarks/results/h200-2026-11-30-cute-dsl.json, bf16, CUDA-graph replays; the
    reasons below give the figures): the forward only up to N = 8192, fwd+bwd for 8192 < N <=
    16384; Triton elsewhere. fp16 moves the bytes bf16 does; fp32 is unmeasured, so it keeps the
    static ranks.
    """
    if a.n is None or str(a.dtype) not in _HALF:
        return None
    if not a.needs_grad and a.n <= 8192:
        return 5, "forward only, N <= 8192: 3.79 vs triton 3.71 TB/s at 16384x4096 (small, 2%; H200 bf16, 2026-11-30)"
    if a.needs_grad and 8192 < a.n <= 16384:
        return 5, "fwd+bwd, 8192 < N <= 16384: 2.16 vs triton 1.77 TB/s at 4096x16384 (1.22x; H200 bf16, 2026-11-30)"
    return None
