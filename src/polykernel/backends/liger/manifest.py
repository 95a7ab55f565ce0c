"""The ops the ``liger`` backend (Liger-Kernel 0.8.5) implements, and its impl row for each
(torch-free; see :mod:`polykernel.backends`). The comparisons below are from
benchmarks/results/h200-2026-11-30-graph.json (bf16, CUDA-graph replays) unless they name a file."""

from . import LIGER, _gates

IMPLS = {
    # Ties the forward, trails far behind with a backward; refuses N > 65536. Behind Triton.
    "norm.rms_norm": LIGER.impl(
        rank=60,
        description="Liger LigerRMSNormFunction (gemma/llama casting, in_place=False); N <= 65536",
        predicate=_gates.rms_norm,
    ),
}
