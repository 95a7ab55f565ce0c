"""The ops the ``sgl_kernel`` backend implements, and its impl row for each (torch-free; see
:mod:`polykernel.backends`). Serving peer, forward only (no backward: passed by when a gradient is
wanted); behind every other impl (rank 75): picked by name or when measured selection picks it. Eagerly at
decode sizes its silu_and_mul / gelu_and_mul launch no cheaper than our kernels from C++ and run
longer on the GPU (h200-2026-12-04-sixth/serving/sweep/sweep_serving.json), so no rule puts it ahead."""

from . import SGL_KERNEL, _gates

IMPLS = {
    "norm.rms_norm": SGL_KERNEL.impl(
        rank=75,
        supports_backward=False,
        description="sgl-kernel rmsnorm / gemma_rmsnorm (offset 0 or 1), forward only; casting='fp32', weight of x's dtype",
        predicate=_gates.rms_norm,
    ),
    "serving.silu_and_mul": SGL_KERNEL.impl(
        rank=75,
        supports_backward=False,
        description="sgl-kernel silu_and_mul (rows in multiples of 16 bytes; dense x and out, else copies)",
        predicate=_gates.silu_and_mul,
    ),
    "serving.gelu_and_mul": SGL_KERNEL.impl(
        rank=75,
        supports_backward=False,
        description="sgl-kernel gelu_and_mul, erf only (its tanh kernel misses the error model; rows in multiples of 16 bytes; dense x and out, else copies)",
        predicate=_gates.gelu_and_mul,
    ),
    # FlashInfer's FusedAddRMSNorm inside sgl-kernel: within the op's error model (see flashinfer's row).
    "serving.fused_add_rms_norm_": SGL_KERNEL.impl(
        rank=75,
        supports_backward=False,
        description="sgl-kernel fused_add_rmsnorm / gemma_fused_add_rmsnorm in place (offset 0 or 1, weight of x's dtype); other layouts: torch",
        predicate=_gates.fused_add_rms_norm_,
    ),
    # It does not guard positions outside the cache (it reads the row named; ours write NaN).
    "serving.rotary_embedding_": SGL_KERNEL.impl(
        rank=75,
        supports_backward=False,
        dtypes=("float32", "bfloat16", "float16"),
        description="sgl-kernel rotary_embedding (vLLM's kernel), float32 only: it computes in the tensors' dtype",
        predicate=_gates.rotary_embedding_,
    ),
}
