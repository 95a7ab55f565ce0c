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
    return shared.and_mul("sgl-kernel", a)


def rotary_embedding_(a: Any) -> str | None:
    # csrc/elementwise/pos_enc.cu (vLLM's kernel): x·cos - y·sin in the tensors' own dtype, each
    # product rounded to it; the op computes in fp32 and rounds once
    if str(a.dtype).removeprefix("torch.") != "float32":
        return f"sgl-kernel's rotary_embedding computes in the tensors' dtype (each product rounded): float32 only, got {str(a.dtype).removeprefix('torch.')}"
    return None


# -- measured ranks (KernelSpec.eager_rank_for) -----------------------------------------------------
# Eagerly a decode-sized call is its launch, and sgl-kernel's silu_and_mul / gelu_and_mul (one
# torch.ops call) launch for less host time than our kernels launched from C++: 25-30% less in the
# tuner's host timing at every point of 1-512 tokens of both ops, and the fastest eager row at most
# of them (h200-2026-12-04-fifth/serving-b/sweep/sweep_serving.json). Ahead of triton (rank 10)
# there only up to 64 tokens (GPU time <= 10 µs, under any host's launch cost), at the measured
# width and dtype; in CUDA graphs, where a call is its GPU time, they trail triton (7.2-9.3 µs
# against 5.6-7.1): an eager-only rule.
_DECODE_TOKENS = 64
_MEASURED_N = 28672  # x's last dim, 2 x 14336 (Llama-8B's intermediate size)


def and_mul_rank(a: Any) -> tuple[int, str] | None:
    """Eagerly, decode sizes (<= 64 tokens, bf16, rows up to 2 x 14336; gelu's erf form): first,
    its launch 25-30% cheaper than ours on the H200."""
    if str(a.dtype) not in shared.HALF or a.tokens is None or a.n is None or getattr(a, "approximate", "none") != "none":
        return None
    if not (0 < a.tokens <= _DECODE_TOKENS and a.n <= _MEASURED_N):
        return None
    return 5, "<= 64 tokens, bf16: sgl-kernel's launch 25-30% below triton's from C++ (H200, 2026-12-04, fifth run)"
