"""The ops the ``quack`` backend (QuACK 0.6.5) implements, and its impl row for each (torch-free;
see :mod:`polykernel.backends`). The comparisons below are from
benchmarks/results/h200-2026-11-30-graph.json (bf16, CUDA-graph replays) unless they name a file."""

from . import QUACK, _gates

IMPLS = {
    # Ties the forward at N <= 16K, leads it on long rows; with a backward it trails at 4096x16384
    # and 512x262144. Static rank behind Triton; the rank_for rule puts it first where it was
    # measured to win: the forward only at N >= 32768.
    "norm.rms_norm": QUACK.impl(
        rank=50,
        description="QuACK rmsnorm (CuTeDSL, cluster reductions); casting='fp32' only; one compile per N",
        predicate=_gates.rms_norm,
        rank_for=_gates.rms_norm_rank,
    ),
    # Ties the forward; with a backward it leads at N = 4096 from 4096 rows on and trails at 256:
    # first in CUDA graphs there (graph_rank_for), behind Triton otherwise.
    "norm.fused_add_rms_norm": QUACK.impl(
        rank=50,
        description="QuACK rmsnorm(residual=, prenorm=True); normalizes the unrounded fp32 sum",
        predicate=_gates.fused_add_rms_norm,
        graph_rank_for=_gates.fused_add_rms_norm_graph_rank,
    ),
    # activation.softmax: QuACK's softmax (0.6.5) is faster than Triton at 8192x32768 but not registered: in the H200
    # parity run (benchmarks/kernels/check_peers.py) it returned non-finite values where the reference has none
    # on rows with a run of -inf logits, failed the fp32 error model on logits of scale 1e4 (it
    # subtracts the max after scaling by log2 e), and its bf16/fp16 backward uses the rounded y.
    # Trails Triton slightly; Liger trails more and syncs the host per call (not CUDA-graph safe;
    # per call in benchmarks/results/h200-2026-11-29.json). Both behind Triton.
    "loss.cross_entropy": QUACK.impl(
        rank=50,
        description="QuACK cross_entropy (CuTeDSL); no label smoothing, weight, softcap or z_loss",
        predicate=_gates.cross_entropy,
    ),
    # QuACK's chunked linear cross-entropy (quack.linear_cross_entropy) is not registered for
    # loss.fused_linear_cross_entropy: on the H200 stack it fails with a CuTeDSL epilogue ContextVar error.
}
