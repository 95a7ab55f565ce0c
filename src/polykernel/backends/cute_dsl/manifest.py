"""The ops the ``cute_dsl`` backend (our CuTeDSL kernels) implements, and its impl row for each
(torch-free; see :mod:`polykernel.backends`)."""

from . import CUTE_DSL, _gates

IMPLS = {
    # rms_norm.py (issue 8): rank 40, behind Triton, by measurement: the forward ties Triton and
    # QuACK at N <= 16K and trails QuACK beyond; fwd+bwd loses to Triton from 4K on
    # (benchmarks/results/h200-2026-11-30-cute-dsl.json). By name only.
    "norm.rms_norm": CUTE_DSL.impl(
        rank=40,
        description="rows in registers, 128-bit vectors, warp/block/cluster sums (rows past 16K over a thread-block cluster, DSMEM); dW from per-CTA partials (deterministic)",
        predicate=_gates.rms_norm,
    ),
}
