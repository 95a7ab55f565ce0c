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
    return shared.gelu_and_mul("FlashInfer", a)


def rotary_embedding_(a: Any) -> str | None:
    if not a.has_key:
        return "FlashInfer's apply_rope_with_cos_sin_cache_inplace needs a key"
    if a.head_size is None:  # a class of unknown sizes (available_impls'): not refused for them
        return None
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
    return shared.long_rows("FlashInfer", a)


# -- measured ranks (KernelSpec.rank_for, graph_rank_for) ------------------------------------------
# Where FlashInfer's kernel beat ours on the H200 (bf16, Llama-8B widths, tokens 1-8192). Rank 5
# puts it ahead of triton (10) there; elsewhere, and in what was not measured (other dtypes, other
# widths, gelu's tanh form), the static ranks stand. Without FlashInfer installed nothing changes.
# At decode sizes its lead is GPU time (CUDA-graph replays: h200-2026-12-04-serving/ and
# h200-2026-12-04-third/serving/sweep_serving.csv), and eagerly its launch costs more than that:
# our kernels, launched from C++, run 1.5-1.9x faster per eager call there
# (h200-2026-12-04-fourth/serving/sweep_serving.csv). Those rules are graph_rank_for: in graphs only.


def silu_and_mul_rank(a: Any) -> tuple[int, str] | None:
    """In CUDA graphs: FlashInfer first for decode-sized calls (<= 16 tokens), 5.2-5.4 µs against
    triton's 5.6-5.9; from 64 tokens on triton leads (2048: 46.7 against 46.9)."""
    if str(a.dtype) not in shared.HALF or a.tokens is None or not 0 < a.tokens <= 16:
        return None
    return 5, "<= 16 tokens in bf16: FlashInfer 3-8% ahead of triton in GPU time (H200, 2026-12-04)"


def gelu_and_mul_rank(a: Any) -> tuple[int, str] | None:
    """FlashInfer first for the erf form at prefill sizes (> 1024 tokens), where the GPU time
    is all of a call's: 56.2-192 µs against triton's 58.1-211, eager and in graphs."""
    if str(a.dtype) not in shared.HALF or a.approximate != "none" or a.tokens is None or not a.tokens > 1024:
        return None
    return 5, "> 1024 tokens, erf, bf16: FlashInfer ahead of triton (H200, 2026-12-04, three sweeps)"


def gelu_and_mul_graph_rank(a: Any) -> tuple[int, str] | None:
    """In CUDA graphs, also at decode sizes (<= 16 tokens): 5.9-6.6 µs against triton's 6.3-7.0;
    triton leads at 64-512 tokens."""
    if str(a.dtype) not in shared.HALF or a.approximate != "none" or a.tokens is None or not 0 < a.tokens <= 16:
        return gelu_and_mul_rank(a)
    return 5, "<= 16 tokens, erf, bf16: FlashInfer 6-11% ahead of triton in GPU time (H200, 2026-12-04, three sweeps)"


def rotary_embedding_rank(a: Any) -> tuple[int, str] | None:
    """In CUDA graphs: FlashInfer first for decode-sized calls (<= 64 tokens, head 128, with a
    key), 5.7-6.5 µs against triton's 5.9-6.7; triton leads from 512 tokens on (48.9 against
    53.7 at 8192)."""
    if str(a.dtype) not in shared.HALF or a.head_size != 128 or not a.has_key or a.tokens is None or not 0 < a.tokens <= 64:
        return None
    return 5, "<= 64 tokens, head 128, bf16: FlashInfer 2-7% ahead of triton in GPU time (H200, 2026-12-04)"
