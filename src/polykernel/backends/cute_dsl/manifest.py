"""The ops the ``cute_dsl`` backend (our CuTeDSL kernels) implements, and its impl row for each
(torch-free; see :mod:`polykernel.backends`)."""

from . import CUTE_DSL, _gates, _predicates

IMPLS = {
    # rms_norm.py (issue 8): rank 40, behind Triton, by measurement: the forward ties Triton and
    # QuACK at N <= 16K and trails QuACK beyond; fwd+bwd loses to Triton from 4K on
    # (benchmarks/results/h200-2026-11-30-cute-dsl.json). By name only.
    "norm.rms_norm": CUTE_DSL.impl(
        rank=40,
        description="rows in registers, 128-bit vectors, warp/block/cluster sums (rows past 16K over a thread-block cluster, DSMEM); dW from per-CTA partials (deterministic)",
        predicate=_gates.rms_norm,
    ),
    # Our CuTeDSL kernel (backends/cute_dsl/softmax.py): ahead of Triton on long rows, behind on
    # short ones (benchmarks/results/h200-2026-11-30-cute-dsl.json). So rank 5 for N >= 16384
    # (rank_for; measured at 32768 only), static 40 (behind Triton) below.
    "activation.softmax": CUTE_DSL.impl(
        rank=40,
        description="one CTA per row, the row in registers (N <= 32768, 16-byte rows); backward recomputes fp32 y from x",
        predicate=_predicates.softmax,
        rank_for=_predicates.softmax_rank,
    ),
    # Our CuTeDSL kernels (backends/cute_dsl/layer_norm.py, issue 8): rank 40, behind Triton,
    # except where the rank_for rule's measurements put them first (short-row forward, mid-row fwd+bwd).
    "norm.layer_norm": CUTE_DSL.impl(
        rank=40,
        description="as cute_dsl rms_norm, centred in registers (two-pass variance); dW/dB from per-CTA partials (deterministic)",
        predicate=_gates.layer_norm,
        rank_for=_gates.layer_norm_rank,
    ),
    # Our CuTeDSL kernel (backends/cute_dsl/cross_entropy.py): ahead of Triton and QuACK at
    # 8192x128256 (benchmarks/results/h200-2026-11-30-cute-dsl.json). So rank 5 for V >= 32768
    # (rank_for; measured at V = 128256 only), static 40 (behind Triton) below.
    "loss.cross_entropy": CUTE_DSL.impl(
        rank=40,
        description="one CTA per row, online softmax over V in 128-bit chunks; backward re-reads the logits with the saved LSE (dlogits rounded once)",
        predicate=_predicates.cross_entropy,
        rank_for=_predicates.cross_entropy_rank,
    ),
}
