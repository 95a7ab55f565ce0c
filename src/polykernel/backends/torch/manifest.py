"""The ops the ``torch`` backend implements, and its impl row for each (torch-free; see
:mod:`polykernel.backends`). Every op has a torch impl: the fallback, eligible everywhere."""

from . import TORCH

IMPLS = {
    "norm.rms_norm": TORCH.impl(rank=100, description="F.rms_norm (PyTorch's fused kernel) for casting='fp32', else the reference"),
    "activation.relu_squared": TORCH.impl(rank=100, description="the reference's fp32 math; backward saves only x"),
    "norm.dyt": TORCH.impl(rank=100, description="the reference's fp32 math; backward saves x and the parameters, recomputes tanh"),
    "norm.poly_norm": TORCH.impl(
        rank=100, description="the reference's fp32 math; backward saves x and the parameters, recomputes the three norms"
    ),
    "norm.group_norm": TORCH.impl(
        rank=100, description="F.group_norm (PyTorch's fused kernel) for fp32/fp64 with parameters in x's dtype, else the reference"
    ),
    "norm.fused_add_rms_norm": TORCH.impl(rank=100, description="x + residual, then the torch rms_norm impl (F.rms_norm where it matches)"),
    "activation.sparsemax": TORCH.impl(
        rank=100, description="sort-based threshold in fp32; backward recomputes the support from x and two fp32 numbers per row"
    ),
    "moe.moe_router": TORCH.impl(rank=100, description="softmax, a stable descending sort of the logits, gather (and renormalize) in fp32"),
    "activation.geglu": TORCH.impl(rank=100, description="the reference's fp32 math; backward saves only gate and up"),
    "activation.swiglu": TORCH.impl(rank=100, description="the reference's fp32 math; backward saves only gate and up"),
    "activation.softmax": TORCH.impl(
        rank=100, description="torch.softmax (fp32 accumulation, x's dtype out); bf16/fp16 backward recomputes fp32 y from x"
    ),
    "norm.layer_norm": TORCH.impl(
        rank=100, description="F.layer_norm (PyTorch's fused kernel) where the parameter dtypes match x, else the reference"
    ),
    "embedding.rope": TORCH.impl(rank=100, description="fp32 rotate-half in eager torch (autograd gives every gradient, cos/sin included)"),
    "embedding.mrope": TORCH.impl(
        rank=100, description="merges the three tables in torch, then rope's reference (autograd gives every gradient)"
    ),
    "loss.cross_entropy": TORCH.impl(
        rank=100,
        description="row-chunked torch (fp32 temporaries O(chunk), not O(N·V)); backward recomputes softmax from the saved LSE",
    ),
    "loss.fused_linear_cross_entropy": TORCH.impl(
        rank=100, description="row chunks: torch matmul + row-chunked torch cross-entropy, gradients during the forward"
    ),
    "serving.silu_and_mul": TORCH.impl(rank=100, description="the reference's fp32 math, copied into out"),
    "serving.gelu_and_mul": TORCH.impl(rank=100, description="the reference's fp32 math, copied into out"),
    "serving.fused_add_rms_norm_": TORCH.impl(rank=100, description="norm.fused_add_rms_norm's torch impl, copied over x and residual"),
    "serving.rotary_embedding_": TORCH.impl(
        rank=100, description="the reference: index_select of the cache rows, fp32 rotation copied back"
    ),
    "serving.dynamic_quant_fp8": TORCH.impl(rank=100, description="the reference: amax, scale, clamp(x / scale) copied into q"),
    "serving.static_quant_fp8": TORCH.impl(rank=100, description="the reference: clamp(x / scale) copied into q"),
    "serving.rms_norm_quant_fp8": TORCH.impl(rank=100, description="the reference: fp32 RMSNorm, clamp(y / scale) copied into q"),
    "moe.moe_experts": TORCH.impl(
        rank=100,
        description="sort by expert once; torch._grouped_mm where it runs (probed per device and dtype), else one matmul per non-empty expert (one host sync)",
    ),
    "moe.moe_experts_gpt_oss": TORCH.impl(
        rank=100,
        description="sort by expert once; torch._grouped_mm where it runs (probed per device and dtype), else one matmul per non-empty expert (one host sync); biases gathered per pair",
    ),
    # The distillation losses: the torch impl is the only fp64 math, everywhere.
    "loss.kl_div": TORCH.impl(rank=100, description="row-chunked torch (fp32 temporaries O(chunk)); closed-form gradients"),
    "loss.jsd": TORCH.impl(
        rank=100, description="row-chunked torch (fp32 temporaries O(chunk)); the gradient in closed form, written in the forward"
    ),
    "loss.tvd": TORCH.impl(
        rank=100, description="row-chunked torch (fp32 temporaries O(chunk)); gradients written in the forward for scalar reductions"
    ),
    "loss.fused_linear_jsd": TORCH.impl(
        rank=100, description="row chunks: fp32 matmul logits + torch JSD per chunk, gradients during the forward"
    ),
    # The preference/RL losses: each loss's formula (its op file's chunked) through the chunked
    # driver (_linear_logps) with the torch per-token primitive (torch/preference.py).
    "loss.fused_linear_dpo_loss": TORCH.impl(
        rank=100,
        target="polykernel.backends.torch.preference:fused_linear_dpo_loss",
        description="pairs in chunks: fp32 matmul logits, torch log-softmax per chunk, gradients during the forward",
    ),
    "loss.fused_linear_orpo_loss": TORCH.impl(
        rank=100,
        target="polykernel.backends.torch.preference:fused_linear_orpo_loss",
        description="pairs in chunks: fp32 matmul logits, torch log-softmax per chunk, gradients during the forward",
    ),
    "loss.fused_linear_cpo_loss": TORCH.impl(
        rank=100,
        target="polykernel.backends.torch.preference:fused_linear_cpo_loss",
        description="pairs in chunks: fp32 matmul logits, torch log-softmax per chunk, gradients during the forward",
    ),
    "loss.fused_linear_simpo_loss": TORCH.impl(
        rank=100,
        target="polykernel.backends.torch.preference:fused_linear_simpo_loss",
        description="pairs in chunks: fp32 matmul logits, torch log-softmax per chunk, gradients during the forward",
    ),
    "loss.fused_linear_kto_loss": TORCH.impl(
        rank=100,
        target="polykernel.backends.torch.preference:fused_linear_kto_loss",
        description="sequences in chunks: fp32 matmul logits, torch log-softmax per chunk, gradients during the forward",
    ),
    "loss.fused_linear_grpo_loss": TORCH.impl(
        rank=100,
        target="polykernel.backends.torch.preference:fused_linear_grpo_loss",
        description="token rows (sequences for sequence-level ratios)"
        " in chunks: fp32 matmul logits, torch log-softmax per chunk, gradients during the forward",
    ),
}
