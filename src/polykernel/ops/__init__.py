"""The op catalog: op id -> the module that defines it (imported on the op's first use).

Each op module is the single source of truth for its op: public function, argument validation,
torch reference, per-dtype tolerances, parity cases and its table of impls.

Importing this package also wires the core to the layers between it and the ops (the core never
imports them): compiled calls to :mod:`polykernel.compile`, DTensor calls to
:mod:`polykernel.distributed` (both imported lazily, on their first use).
"""

from .. import compile as _compile
from .. import distributed as _distributed
from ..core.hooks import hooks as _hooks

_hooks.install(compiled_call=_compile.custom_op_for, dtensor_route=_distributed.route, dtensor_explain=_distributed.explain_local)

OP_MODULES: dict[str, str] = {
    "norm.rms_norm": "polykernel.ops.rms_norm",
    "norm.fused_add_rms_norm": "polykernel.ops.fused_add_rms_norm",
    "norm.layer_norm": "polykernel.ops.layer_norm",
    "norm.group_norm": "polykernel.ops.group_norm",
    "norm.dyt": "polykernel.ops.dyt",
    "norm.poly_norm": "polykernel.ops.poly_norm",
    "activation.swiglu": "polykernel.ops.swiglu",
    "activation.geglu": "polykernel.ops.geglu",
    "activation.softmax": "polykernel.ops.softmax",
    "activation.relu_squared": "polykernel.ops.relu_squared",
    "activation.sparsemax": "polykernel.ops.sparsemax",
    "embedding.rope": "polykernel.ops.rope",
    "embedding.mrope": "polykernel.ops.mrope",
    "loss.cross_entropy": "polykernel.ops.cross_entropy",
    "loss.fused_linear_cross_entropy": "polykernel.ops.fused_linear_cross_entropy",
    # serving layouts (issue 25): inference only, writing into given or in-place tensors
    "serving.silu_and_mul": "polykernel.ops.silu_and_mul",
    "serving.gelu_and_mul": "polykernel.ops.gelu_and_mul",
    "serving.fused_add_rms_norm_": "polykernel.ops.fused_add_rms_norm_",
    "serving.rotary_embedding_": "polykernel.ops.rotary_embedding_",
    "serving.dynamic_quant_fp8": "polykernel.ops.dynamic_quant_fp8",
    "serving.static_quant_fp8": "polykernel.ops.static_quant_fp8",
    "serving.rms_norm_quant_fp8": "polykernel.ops.rms_norm_quant_fp8",
    # mixture of experts (issue 24)
    "moe.moe_experts": "polykernel.ops.moe_experts",
    "moe.moe_router": "polykernel.ops.moe_router",
    "moe.moe_experts_gpt_oss": "polykernel.ops.moe_experts_gpt_oss",
    "loss.kl_div": "polykernel.ops.kl_div",
    "loss.jsd": "polykernel.ops.jsd",
    "loss.tvd": "polykernel.ops.tvd",
    "loss.fused_linear_jsd": "polykernel.ops.fused_linear_jsd",
    # fused preference and RL losses (issue 22)
    "loss.fused_linear_dpo_loss": "polykernel.ops.fused_linear_dpo_loss",
    "loss.fused_linear_orpo_loss": "polykernel.ops.fused_linear_orpo_loss",
    "loss.fused_linear_cpo_loss": "polykernel.ops.fused_linear_cpo_loss",
    "loss.fused_linear_simpo_loss": "polykernel.ops.fused_linear_simpo_loss",
    "loss.fused_linear_kto_loss": "polykernel.ops.fused_linear_kto_loss",
    "loss.fused_linear_grpo_loss": "polykernel.ops.fused_linear_grpo_loss",
}
