"""The ops the ``flashinfer`` backend implements, and its impl row for each (torch-free; see
:mod:`polykernel.backends`). Serving peer, forward only (no backward: passed by when a gradient is
wanted); behind every other impl (rank 70) except where the H200 measured it ahead (``rank_for``
and, in CUDA graphs only, ``graph_rank_for`` rules, _gates.py), else by name or when measured selection picks it."""

from ..declare import FP8_CAPS
from . import FLASHINFER, _gates

IMPLS = {
    "norm.rms_norm": FLASHINFER.impl(
        rank=70,
        supports_backward=False,
        description="FlashInfer rmsnorm / gemma_rmsnorm (offset 0 or 1), forward only; casting='fp32', weight of x's dtype",
        predicate=_gates.rms_norm,
    ),
    "serving.silu_and_mul": FLASHINFER.impl(
        rank=70,
        supports_backward=False,
        description="FlashInfer silu_and_mul (rows in multiples of 16 bytes; dense x and out, else copies)",
        predicate=_gates.silu_and_mul,
        graph_rank_for=_gates.silu_and_mul_rank,
    ),
    "serving.gelu_and_mul": FLASHINFER.impl(
        rank=70,
        supports_backward=False,
        description="FlashInfer gelu_and_mul, erf only (its tanh kernel misses the error model; rows in multiples of 16 bytes; dense x and out, else copies)",
        predicate=_gates.gelu_and_mul,
        rank_for=_gates.gelu_and_mul_rank,
        graph_rank_for=_gates.gelu_and_mul_graph_rank,
    ),
    # FlashInfer's FusedAddRMSNorm (also inside sgl-kernel) normalises the fp32 sum before rounding
    # it, within the op's error model.
    "serving.fused_add_rms_norm_": FLASHINFER.impl(
        rank=70,
        supports_backward=False,
        description="FlashInfer fused_add_rmsnorm / gemma_fused_add_rmsnorm in place (offset 0 or 1, weight of x's dtype); other layouts: torch",
        predicate=_gates.fused_add_rms_norm_,
    ),
    # It does not guard positions outside the cache (it reads the row named; ours write NaN).
    "serving.rotary_embedding_": FLASHINFER.impl(
        rank=70,
        supports_backward=False,
        description="FlashInfer apply_rope_with_cos_sin_cache_inplace (with a key; head 64/128/256/512; fp32 cache, 16-bit widened)",
        predicate=_gates.rotary_embedding_,
        graph_rank_for=_gates.rotary_embedding_rank,
    ),
    "serving.rms_norm_quant_fp8": FLASHINFER.impl(
        rank=70,
        capabilities=FP8_CAPS,
        supports_backward=False,
        description="FlashInfer rmsnorm_quant (one scale per tensor, weight of x's dtype; x times 1/scale; a row with NaN or inf comes out finite, clamped to ±448, where the op keeps NaN)",
        predicate=_gates.rms_norm_quant_fp8,
    ),
}
