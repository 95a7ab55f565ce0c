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
    # Liger-Kernel 0.8.5's LigerReLUSquaredFunction is not registered: its relu is tl.maximum(x, 0),
    # which turns a NaN into 0, forward and backward (checked on the CPU interpreter), where the
    # contract keeps NaN (torch's relu): a NaN hidden from the caller. It is also one block per row
    # (N <= 65536) compiled per N, for an elementwise pass that Triton already runs at copy speed.
    # Liger (0.8.5): autotuned kernels (a timing sweep on the first call of each N: not CUDA-graph
    # safe), weight required, and its dalpha and dbias are cast to x's dtype before autograd casts
    # them to the parameters': the parameters in x's dtype only. Its forward edges ours, its
    # backward trails ours far (benchmarks/results/h200-2026-12-01-moreops-call.json): behind Triton.
    "norm.dyt": LIGER.impl(
        rank=60,
        graph_safe=False,
        description="Liger LigerDyTFunction (autotuned); parameters in x's dtype; dalpha/dW/dB from per-SM partials",
        predicate=_gates.dyt,
    ),
    # Liger (0.8.5): its forward computes x², x³ and their sums in x's dtype (bf16 powers): fp32
    # only; one block per row (N <= 65536). in_place=False (Liger's default writes dX into dY).
    # Behind Triton until measured. Unscaled: x⁶ overflows fp32 for |x| > 2.6e6 (y then b, or NaN),
    # which no predicate can see (it reads no values): documented in its description.
    "norm.poly_norm": LIGER.impl(
        rank=60,
        dtypes=("float32",),
        description="Liger LigerPolyNormFunction (in_place=False); N <= 65536; unscaled: wrong for |x| > 2.6e6 (x⁶ overflows fp32)",
        predicate=_gates.poly_norm,
    ),
    # Liger (0.8.5): its variance is E[x²] - E[x]² (it cancels on offset data), its mean and rstd
    # are stored in x's dtype (bf16 statistics in the backward), and dW/dB use atomics: fp32 only,
    # not deterministic, weight and bias both given. Behind Triton until measured.
    "norm.group_norm": LIGER.impl(
        rank=60,
        dtypes=("float32",),
        deterministic=False,
        description="Liger LigerGroupNormFunction; weight and bias given, in x's dtype; dW/dB by atomics",
        predicate=_gates.group_norm,
    ),
    "norm.fused_add_rms_norm": LIGER.impl(
        rank=60,
        description="Liger LigerFusedAddRMSNormFunction (gemma casting); N <= 65536",
        predicate=_gates.fused_add_rms_norm,
    ),
    # Liger (0.8.5): its backward rounds mean_S(dy) to x's dtype before the subtraction and reads the
    # support from the saved y: bf16/fp16 gradients 1.1-18x the error model (H200, 2026-12-01,
    # check_parity large=True): fp32 only. Its forward sorts each row with torch.sort: ~16x slower
    # than Triton in bf16 (benchmarks/results/h200-2026-12-01-moreops-call.json). Behind Triton.
    "activation.sparsemax": LIGER.impl(
        rank=60,
        dtypes=("float32",),
        description="Liger LigerSparsemaxFunction (torch.sort, then one block per row); N <= 65536; backward from the saved y",
        predicate=_gates.sparsemax,
    ),
    # Liger: trails Triton: behind it. Its predicate refuses N > 65536 (one block per row) and the
    # exact erf form. bf16/fp16 round gelu(gate) before the multiply, outside the one-rounding
    # error model (benchmarks/kernels/check_peers.py on the H200); fp32 passes.
    "activation.geglu": LIGER.impl(
        rank=60,
        dtypes=("float32",),
        description="Liger LigerGELUMulFunction (tanh only); gate/up copied when grad is on",
        predicate=_gates.geglu,
    ),
    # Liger: a tie at copy speed: behind Triton. One block per row: its predicate refuses N > 65536.
    # bf16/fp16 round silu(gate) before the multiply, outside the one-rounding error model
    # (benchmarks/kernels/check_peers.py on the H200); fp32 passes.
    "activation.swiglu": LIGER.impl(
        rank=60,
        dtypes=("float32",),
        description="Liger LigerSiLUMulFunction (silu(gate) rounded to up's dtype before the multiply); gate/up copied when grad is on",
        predicate=_gates.swiglu,
    ),
    # Liger: faster fwd+bwd at 8192x32768 (one shape measured) but refuses N > 65536, and its
    # bf16/fp16 backward from the rounded y fails the error model (same run): fp32 only, behind Triton.
    "activation.softmax": LIGER.impl(
        rank=60,
        dtypes=("float32",),
        description="Liger LigerSoftmaxFunction; N <= 65536; backward from the saved y",
        predicate=_gates.softmax,
    ),
    # Liger: trails Triton, most with a backward: behind it. (QuACK's LayerNorm has no autograd
    # wrapper and takes fp32 weight and bias only: not adapted.)
    "norm.layer_norm": LIGER.impl(
        rank=60,
        description="Liger LigerLayerNormFunction; weight and bias required; N <= 65536",
        predicate=_gates.layer_norm,
    ),
    # Liger's RoPE (0.8.5) is not registered: in the H200 parity run (benchmarks/kernels/check_peers.py)
    # it failed the error model by orders of magnitude with cos/sin halves that differ, strided
    # cos/sin, D = 272 and decode shapes (it reads only the first half of each cos/sin row and
    # computes in the tables' dtype), and it trailed Triton (h200-2026-11-29-graph.json).
    # (QuACK's rotary takes another layout, [B, T, H, D] with half-width cos/sin: not adapted.)
    # Liger's qwen2vl_mrope (0.8.5) is not registered either: its kernel reads only the first half
    # of each table row (it assumes equal halves; the contract's tables need not have them), needs
    # the tables' batch to be B (no batch-1 broadcast), computes in the tables' dtype, and rotates
    # q/k in place: HF's transposed q (a contiguous [B, T, H, D]) would be overwritten.
    # Trails QuACK and Triton and syncs the host per call (not CUDA-graph safe; per call in
    # benchmarks/results/h200-2026-11-29.json): behind Triton. bf16/fp16 gradients fail the error
    # model (benchmarks/kernels/check_peers.py on the H200); fp32 passes.
    "loss.cross_entropy": LIGER.impl(
        rank=60,
        dtypes=("float32",),
        graph_safe=False,
        description="Liger's CE kernel with an fp32 loss and a private gradient buffer (the logits stay unwritten); host sync per call",
        predicate=_gates.cross_entropy,
    ),
    # Slower per call, with less extra memory, and a host sync per call (not CUDA-graph safe;
    # benchmarks/results/h200-2026-11-29.json). Behind Triton.
    "loss.fused_linear_cross_entropy": LIGER.impl(
        rank=60,
        graph_safe=False,
        description="Liger LigerFusedLinearCrossEntropyFunction (grads in the forward, fp32 dW accumulation); host sync per call",
        predicate=_gates.fused_linear_cross_entropy,
    ),
    # Liger 0.8.5's LigerFusedMoEFunction: SwiGLU experts only; one host sync per call (its tile
    # count), and its routing-weight gradient is summed with atomics. Not measured on the H200
    # (it timed out in the model runs of benchmarks/results/h200-2026-12-03-moe/): behind Triton.
    "moe.moe_experts": LIGER.impl(
        rank=60,
        dtypes=("bfloat16", "float16"),
        deterministic=False,
        graph_safe=False,
        description="Liger LigerFusedMoEFunction (SwiGLU only; pre-activations and expert outputs rounded to the dtype); host sync per call",
        predicate=_gates.moe_experts,
    ),
    # The distillation losses (Liger-Kernel 0.8.5): behind Triton until measured on the H200; not
    # CUDA-graph safe (they sync with the host).
    "loss.kl_div": LIGER.impl(
        rank=60,
        graph_safe=False,
        description="Liger LigerKLDivLossFunction (log t clamped at eps = 1e-10); no target gradient; host sync in its backward",
        predicate=_gates.kl_div,
    ),
    "loss.jsd": LIGER.impl(
        rank=60,
        graph_safe=False,
        description="Liger's _jsd_kernel (an fp32 [N, V] loss buffer; NaN where a probability is 0); host sync per call",
        predicate=_gates.jsd,
    ),
    "loss.tvd": LIGER.impl(
        rank=60, graph_safe=False, description="Liger LigerTVDLossFunction (gradient for p only); host sync per call", predicate=_gates.tvd
    ),
    "loss.fused_linear_jsd": LIGER.impl(
        rank=60,
        graph_safe=False,
        description="Liger LigerFusedLinearJSDFunction (fp32 dW accumulation; NaN where a probability is 0); host sync per call",
        predicate=_gates.fused_linear_jsd,
    ),
    # The preference/RL losses (liger_kernel.chunked_loss; the adapters in preference.py): behind
    # Triton, host sync per call. No KTO: Liger's reports batch sums, not per-sequence statistics.
    "loss.fused_linear_dpo_loss": LIGER.impl(
        rank=60,
        graph_safe=False,
        target="polykernel.backends.liger.preference:fused_linear_dpo_loss",
        description="Liger LigerFusedLinearDPOFunction (logits in the inputs' dtype; nll_loss NaN unless compute_nll_loss)",
        predicate=_gates.fused_linear_dpo_loss,
    ),
    "loss.fused_linear_orpo_loss": LIGER.impl(
        rank=60,
        graph_safe=False,
        target="polykernel.backends.liger.preference:fused_linear_orpo_loss",
        description="Liger LigerFusedLinearORPOFunction (logits in the inputs' dtype; nll_loss NaN unless compute_nll_loss)",
        predicate=_gates.fused_linear_orpo_loss,
    ),
    "loss.fused_linear_cpo_loss": LIGER.impl(
        rank=60,
        graph_safe=False,
        target="polykernel.backends.liger.preference:fused_linear_cpo_loss",
        description="Liger LigerFusedLinearCPOFunction (logits in the inputs' dtype; nll_loss NaN when alpha = 0)",
        predicate=_gates.fused_linear_cpo_loss,
    ),
    "loss.fused_linear_simpo_loss": LIGER.impl(
        rank=60,
        graph_safe=False,
        target="polykernel.backends.liger.preference:fused_linear_simpo_loss",
        description="Liger LigerFusedLinearSimPOFunction (logits in the inputs' dtype)",
        predicate=_gates.fused_linear_simpo_loss,
    ),
    "loss.fused_linear_grpo_loss": LIGER.impl(
        rank=60,
        graph_safe=False,
        target="polykernel.backends.liger.preference:fused_linear_grpo_loss",
        description="Liger LigerFusedLinearGRPOFunction (region clip ratio only, the others NaN; logits in the inputs' dtype)",
        predicate=_gates.fused_linear_grpo_loss,
    ),
}
