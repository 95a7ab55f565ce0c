"""Per-call predicates of the QuACK impls (torch-free: they read the op's argument class)."""

from __future__ import annotations

from typing import Any

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _bytes(dtype: Any) -> int:
    return _BYTES.get(str(dtype).removeprefix("torch."), 4)


def _vectors(a: Any) -> str | None:
    # N = 1, 7, 33 and 70001 in bf16/fp16 fail to compile ("could not build valid IR"; the H200
    # parity run, benchmarks/kernels/check_peers.py): QuACK's row kernels load 16 bytes at a time
    vec, n = 16 // _bytes(a.dtype), getattr(a, "n", None) or getattr(a, "n_classes", None)
    if n is not None and n % vec:
        return f"QuACK needs N divisible by {vec} (16-byte loads); N = {n}"
    return None


def rms_norm(a: Any) -> str | None:
    if _vectors(a):
        return _vectors(a)
    if a.casting != "fp32":
        return "QuACK has casting='fp32' only (x̂ and the weight multiply in fp32, one cast)"
    # quack/rmsnorm.py RMSNormBackward: "does not support N > 128k with dtype >= 32 bits" (smem)
    if a.needs_grad and _bytes(a.dtype) >= 4 and a.n is not None and a.n > 128 * 1024:
        return f"QuACK's RMSNorm backward refuses N > 131072 in fp32 (shared memory); N = {a.n}"
    return None


_HALF = ("torch.bfloat16", "torch.float16", "bfloat16", "float16")


def rms_norm_rank(a: Any) -> tuple[int, str] | None:
    """Measured rule (KernelSpec.rank_for): QuACK first for the forward only of long 16-bit rows.

    QuACK's forward leads from N = 32K on; at N <= 16K quack, triton and cute_dsl tie (Triton stays
    first), and with a backward Triton wins or ties at long N (bf16, CUDA-graph replays:
    benchmarks/results/h200-2026-11-30-cute-dsl.json; the reason below gives the figures). fp16
    moves the bytes bf16 does; fp32 is unmeasured, so it keeps the static ranks.
    """
    if a.needs_grad or a.n is None or a.n < 32768 or str(a.dtype) not in _HALF:
        return None
    return 5, "forward only, N >= 32768: 3.64-3.75 TB/s vs triton 2.50-2.84 (1.3-1.45x; H200 bf16, 2026-11-30)"


def fused_add_rms_norm_graph_rank(a: Any) -> tuple[int, str] | None:
    """Measured rule (KernelSpec.graph_rank_for: GPU time alone): QuACK first for the fused add +
    RMSNorm with a backward in 16-bit at N = 4096, the row length measured (bf16, CUDA-graph
    replays: h200-2026-11-30-graph.json, h200-2026-12-01-redesign/graph.json,
    h100-2026-12-05-fourteenth/graph.json). Behind Triton at 256 rows (0.0226 vs 0.019 ms), tied at
    1024; the class does not know the rows, and a backward comes with a training step's thousands.
    Eager calls keep the static ranks: QuACK's host cost per call is unmeasured."""
    if not a.needs_grad or a.n != 4096 or str(a.dtype) not in _HALF:
        return None
    return 5, "fwd+bwd, N = 4096: 0.88-0.96x triton's GPU time at 4096-16384 rows (H200 2026-11-30/12-01, H100 2026-12-05)"


# Shared memory per CTA on sm_90 (227 KiB), and QuACK 0.6.5's forward cluster size per row length
# (quack/rmsnorm_config.py, Hopper): the row is split over a cluster of CTAs, each staging its slice.
SMEM_BYTES = 232448
_CLUSTER = {2: ((16384, 1), (32768, 2), (65536, 4), (131072, 8)), 4: ((32768, 1), (65536, 2), (131072, 4), (262144, 8))}


def _residual_smem(a: Any) -> int:
    """Bytes of shared memory QuACK's fused add + RMSNorm forward asks per CTA: x's and the
    residual's slices of a row, plus ~264 bytes of reduction buffer (H200: 262,408 at N = 262144
    in fp32, which fails to launch)."""
    width = _bytes(a.dtype)
    cluster = next((c for limit, c in _CLUSTER[2 if width == 2 else 4] if a.n <= limit), 16)
    return 2 * -(-a.n // cluster) * width + 512


def fused_add_rms_norm(a: Any) -> str | None:
    if _vectors(a):
        return _vectors(a)
    if a.n is not None and _residual_smem(a) > SMEM_BYTES:
        return f"QuACK's fused add + RMSNorm needs {_residual_smem(a)} bytes of shared memory per CTA at N = {a.n} in {str(a.dtype).removeprefix('torch.')} (sm_90 has {SMEM_BYTES})"
    if a.needs_grad and _bytes(a.dtype) >= 4 and a.n is not None and a.n > 128 * 1024:
        return f"QuACK's RMSNorm backward refuses N > 131072 in fp32 (shared memory); N = {a.n}"
    return None


def cross_entropy(a: Any) -> str | None:
    if _vectors(a):  # V = 1, 3001, 4999 failed to compile in bf16/fp16 on the H200
        return _vectors(a)
    if a.label_smoothing:
        return "QuACK's cross-entropy has no label_smoothing"
    return _ce_options(a, "QuACK's cross-entropy")


def _ce_options(a: Any, who: str) -> str | None:
    """The cross-entropy options QuACK lacks (class weights, softcap, z_loss)."""
    if getattr(a, "has_weight", False):
        return f"{who} has no class weights (weight)"
    if getattr(a, "softcap", None) is not None:
        return f"{who} has no softcap"
    if getattr(a, "z_loss", 0.0):
        return f"{who} has no z_loss"
    return None
