"""The ops the ``triton`` backend implements, and its impl row for each (torch-free; see
:mod:`polykernel.backends`)."""

from ..declare import FP8_CAPS
from . import TRITON, _gates

IMPLS = {
    "norm.rms_norm": TRITON.impl(
        rank=10, description="one row per program (chunked for long rows); dW from per-program partials (deterministic)"
    ),
    "activation.relu_squared": TRITON.impl(
        rank=10,
        description="one elementwise pass each way over x's dense layout (any other layout is copied first); backward recomputes relu(x)",
    ),
    "norm.dyt": TRITON.impl(
        rank=10,
        description="one elementwise pass forward; backward over (rows, column blocks), dalpha/dW/dB from per-program partials (deterministic)",
    ),
    "norm.poly_norm": TRITON.impl(
        rank=10,
        description="one row per program (chunked for long rows), the three rstd saved; dW/dB from per-program partials (deterministic)",
    ),
    "norm.group_norm": TRITON.impl(
        rank=10,
        description="one (sample, group) per program as a [channels, positions] tile (chunked for large groups); dW/dB from per-program partials (deterministic)",
    ),
    "norm.fused_add_rms_norm": TRITON.impl(
        rank=10, description="add + RMSNorm in one pass (chunked for long rows); dW from per-program partials (deterministic)"
    ),
    "activation.sparsemax": TRITON.impl(
        rank=10,
        description="no sort: Michelot's support refinement from τ = max - 1, in registers up to 16K (chunked passes beyond); backward recomputes the support",
    ),
    "activation.geglu": TRITON.impl(
        rank=10, description="one elementwise pass each way (flat or row-strided, 16-byte accesses); backward recomputes gelu"
    ),
    "activation.swiglu": TRITON.impl(
        rank=10, description="one elementwise pass each way (flat or row-strided, 16-byte accesses); backward recomputes silu"
    ),
    "activation.softmax": TRITON.impl(
        rank=10,
        description="one block per row up to 32K (one read, one write), online chunked beyond (rows split when few); backward recomputes fp32 y from x",
    ),
    "norm.layer_norm": TRITON.impl(
        rank=10, description="one row per program (chunked for long rows); dW/dB from per-program partials (deterministic)"
    ),
    "embedding.rope": TRITON.impl(
        rank=10,
        description="a tile of positions per program, all q and k heads, cos/sin loaded once; strided (no copies); "
        "backward is the same kernel rotating by -sin",
        predicate=_gates.rope,
    ),
    "embedding.mrope": TRITON.impl(
        rank=10,
        description="merges the tables in torch ([B, T, D], a small copy), then rope's Triton kernels, forward and backward",
        predicate=_gates.rope,
    ),
    "loss.cross_entropy": TRITON.impl(
        rank=10,
        description="one program per row, online softmax over V in chunks; backward re-reads the logits with the saved LSE",
    ),
    "loss.fused_linear_cross_entropy": TRITON.impl(
        rank=10,
        description="row chunks: torch matmul + the Triton cross-entropy kernel (loss and dlogits in one launch, in place)",
    ),
    "serving.silu_and_mul": TRITON.impl(
        rank=10,
        supports_backward=False,
        description="swiglu's elementwise kernel on x's two halves (row-strided views: no copy), writing out",
    ),
    "serving.gelu_and_mul": TRITON.impl(
        rank=10,
        supports_backward=False,
        description="geglu's elementwise kernel (erf or tanh) on x's two halves (row-strided views: no copy), writing out",
    ),
    "serving.fused_add_rms_norm_": TRITON.impl(
        rank=10,
        supports_backward=False,
        description="norm.fused_add_rms_norm's forward kernel writing y over x and s over residual (one launch, no allocation)",
    ),
    "serving.rotary_embedding_": TRITON.impl(
        rank=10,
        supports_backward=False,
        description="one program per (token, block of heads of q or k): the token's cos/sin row gathered once, pairs rotated in place",
    ),
    "serving.dynamic_quant_fp8": TRITON.impl(
        rank=10,
        capabilities=FP8_CAPS,
        supports_backward=False,
        description="per token: one pass per row (amax, then quantise from registers; chunked past 16K); per tensor: a max kernel (integer atomics, deterministic) then the static quantiser",
    ),
    "serving.static_quant_fp8": TRITON.impl(
        rank=10,
        capabilities=FP8_CAPS,
        supports_backward=False,
        description="one elementwise pass ([ROWS, BLOCK] tiles, the scale read once per row)",
    ),
    "serving.rms_norm_quant_fp8": TRITON.impl(
        rank=10,
        capabilities=FP8_CAPS,
        supports_backward=False,
        description="one pass per row block (normalise, weight, scale, e4m3 from registers; chunked past 16K)",
    ),
    # moe_experts' ranks follow the H200 (bf16, fwd+bwd, 2026-12-03: benchmarks/results/h200-2026-12-03-moe/):
    # triton (its grouped_mm path) was the fastest impl at the three model shapes and at every point
    # of the sweep, the torch impl 1.1-2.3x slower; Liger's was not measured (it timed out in the
    # model runs). fp32 on the GPU (triton's own GEMMs, IEEE) is unmeasured and keeps these ranks.
    "moe.moe_experts": TRITON.impl(
        rank=10,
        description="sort by expert once; on a GPU in 16-bit, torch._grouped_mm GEMMs with our kernels for act(g)·u, its backward and the k-sum; else our grouped GEMMs with those fused in their epilogues; no atomics",
    ),
    "moe.moe_experts_gpt_oss": TRITON.impl(
        rank=10,
        description="moe_experts' two paths in gpt-oss's layout (torch._grouped_mm on a GPU in 16-bit, else our grouped GEMMs): interleaved columns, biases and the clamped SwiGLU in our kernels; no atomics",
    ),
    # The distillation losses: fp32 math, so no float64 second input (fp64 math is the torch impl's).
    "loss.kl_div": TRITON.impl(
        rank=10,
        description="one program per row, chunked over V; the gradient written in the forward (scalar reductions), scaled by the cotangent in the backward",
        predicate=_gates.kl_div,
    ),
    "loss.jsd": TRITON.impl(
        rank=10,
        description="one program per row, one pass over V in chunks: loss and gradient together (no host sync); backward scales by the cotangent",
        predicate=_gates.jsd,
    ),
    "loss.tvd": TRITON.impl(
        rank=10,
        description="one program per row, one pass over V in chunks: loss and gradients together (no host sync); backward scales by the cotangent",
        predicate=_gates.tvd,
    ),
    "loss.fused_linear_jsd": TRITON.impl(
        rank=10,
        description="row chunks: fp32-output matmuls + one Triton kernel per chunk (both log-softmaxes, loss and dlogits; no host sync)",
        predicate=_gates.fused_linear_jsd,
    ),
    # The preference/RL losses: the torch impls' chunked driver with the Triton per-token primitive
    # (triton/preference.py; fp32 math).
    "loss.fused_linear_dpo_loss": TRITON.impl(
        rank=10,
        target="polykernel.backends.triton.preference:fused_linear_dpo_loss",
        description="pairs in chunks: fp32-output matmuls + Triton log-prob and dlogits kernels, gradients during the forward",
    ),
    "loss.fused_linear_orpo_loss": TRITON.impl(
        rank=10,
        target="polykernel.backends.triton.preference:fused_linear_orpo_loss",
        description="pairs in chunks: fp32-output matmuls + Triton log-prob and dlogits kernels, gradients during the forward",
    ),
    "loss.fused_linear_cpo_loss": TRITON.impl(
        rank=10,
        target="polykernel.backends.triton.preference:fused_linear_cpo_loss",
        description="pairs in chunks: fp32-output matmuls + Triton log-prob and dlogits kernels, gradients during the forward",
    ),
    "loss.fused_linear_simpo_loss": TRITON.impl(
        rank=10,
        target="polykernel.backends.triton.preference:fused_linear_simpo_loss",
        description="pairs in chunks: fp32-output matmuls + Triton log-prob and dlogits kernels, gradients during the forward",
    ),
    "loss.fused_linear_kto_loss": TRITON.impl(
        rank=10,
        target="polykernel.backends.triton.preference:fused_linear_kto_loss",
        description="sequences in chunks: fp32-output matmuls + Triton log-prob and dlogits kernels, gradients during the forward",
    ),
    "loss.fused_linear_grpo_loss": TRITON.impl(
        rank=10,
        target="polykernel.backends.triton.preference:fused_linear_grpo_loss",
        description="token rows (sequences for sequence-level ratios)"
        " in chunks: fp32-output matmuls + Triton log-prob and dlogits kernels, gradients during the forward",
    ),
}
