"""polykernel: LLM kernels with several implementations each, and one dispatcher that picks,
per call and per device, the fastest one that is correct and runnable there.

    >>> import torch, polykernel
    >>> y = polykernel.rms_norm(torch.randn(4, 8), torch.ones(8))
    >>> print(polykernel.explain("rms_norm", device="cpu"))  # doctest: +SKIP

Public names load lazily (PEP 562), so ``import polykernel`` does not import torch, and
``polykernel.spec`` works where torch is missing.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> "module:attr" (module relative to this package)
_LAZY: dict[str, str] = {
    # metadata (torch-free)
    "KernelBackend": "spec:KernelBackend",
    "DeviceType": "spec:DeviceType",
    "PlatformInfo": "spec:PlatformInfo",
    "CapabilityRequirement": "spec:CapabilityRequirement",
    "capabilities_satisfied": "spec:capabilities_satisfied",
    "FormatSignature": "spec:FormatSignature",
    "KernelSpec": "spec:KernelSpec",
    # errors
    "PolykernelError": "errors:PolykernelError",
    "ImplNotAvailableError": "errors:ImplNotAvailableError",
    "UnknownOpError": "errors:UnknownOpError",
    "OpArgumentError": "errors:OpArgumentError",
    "OpTypeError": "errors:OpTypeError",
    "ImplVerificationError": "errors:ImplVerificationError",
    # registry and dispatcher
    "register_impl": "core.registry:register_impl",
    "declare_op_locations": "core.registry:declare_op_locations",
    "use_impl": "core.selection:use_impl",
    "set_impl": "core.selection:set_impl",
    "available_impls": "core.selection:available_impls",
    "explain": "core.selection:explain",
    "clear_caches": "core.selection:clear_caches",
    "decisions": "core.selection:decisions",
    "sync_decisions": "tuning:sync_decisions",
    "list_ops": "core.registry:all_op_ids",
    # ops
    "rms_norm": "ops.rms_norm:rms_norm",
    "fused_add_rms_norm": "ops.fused_add_rms_norm:fused_add_rms_norm",
    "layer_norm": "ops.layer_norm:layer_norm",
    "group_norm": "ops.group_norm:group_norm",
    "dyt": "ops.dyt:dyt",
    "poly_norm": "ops.poly_norm:poly_norm",
    "swiglu": "ops.swiglu:swiglu",
    "geglu": "ops.geglu:geglu",
    "softmax": "ops.softmax:softmax",
    "relu_squared": "ops.relu_squared:relu_squared",
    "sparsemax": "ops.sparsemax:sparsemax",
    "rope": "ops.rope:rope",
    "mrope": "ops.mrope:mrope",
    "cross_entropy": "ops.cross_entropy:cross_entropy",
    "fused_linear_cross_entropy": "ops.fused_linear_cross_entropy:fused_linear_cross_entropy",
    # serving layouts (inference only)
    "silu_and_mul": "ops.silu_and_mul:silu_and_mul",
    "gelu_and_mul": "ops.gelu_and_mul:gelu_and_mul",
    "fused_add_rms_norm_": "ops.fused_add_rms_norm_:fused_add_rms_norm_",
    "rotary_embedding_": "ops.rotary_embedding_:rotary_embedding_",
    "dynamic_quant_fp8": "ops.dynamic_quant_fp8:dynamic_quant_fp8",
    "static_quant_fp8": "ops.static_quant_fp8:static_quant_fp8",
    "rms_norm_quant_fp8": "ops.rms_norm_quant_fp8:rms_norm_quant_fp8",
    # mixture of experts
    "moe_experts": "ops.moe_experts:moe_experts",
    "moe_router": "ops.moe_router:moe_router",
    "moe_experts_gpt_oss": "ops.moe_experts_gpt_oss:moe_experts_gpt_oss",
    "kl_div": "ops.kl_div:kl_div",
    "jsd": "ops.jsd:jsd",
    "tvd": "ops.tvd:tvd",
    "fused_linear_jsd": "ops.fused_linear_jsd:fused_linear_jsd",
    # preference and RL losses fused with the LM head (plain functions, not catalog ops)
    "fused_linear_dpo_loss": "ops.fused_linear_dpo_loss:fused_linear_dpo_loss",
    "fused_linear_grpo_loss": "ops.fused_linear_grpo_loss:fused_linear_grpo_loss",
    "fused_linear_orpo_loss": "ops.fused_linear_orpo_loss:fused_linear_orpo_loss",
    "fused_linear_cpo_loss": "ops.fused_linear_cpo_loss:fused_linear_cpo_loss",
    "fused_linear_simpo_loss": "ops.fused_linear_simpo_loss:fused_linear_simpo_loss",
    "fused_linear_kto_loss": "ops.fused_linear_kto_loss:fused_linear_kto_loss",
}
_SUBMODULES = (
    "spec",
    "errors",
    "nn",
    "testing",
    "integrations",
    "core",
    "tuning",
    "compile",
    "distributed",
    "ops",
    "backends",
    "tools",
)
# Names of modules before the packages by layer (issue 26): still reachable as attributes.
_MOVED = {
    "dispatch": "core.selection",
    "registry": "core.registry",
    "library": "compile.library",
    "models": "tools.models",
    "demo": "tools.demo",
    "cli": "tools.cli",
    "bench": "tools.bench",
}

__all__ = sorted([*_LAZY, *_SUBMODULES, "__version__"])


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is not None:
        module_name, _, attr = target.partition(":")
        value = getattr(importlib.import_module(f".{module_name}", __name__), attr)
        globals()[name] = value  # later lookups skip this function
        return value
    if name in _SUBMODULES or name in _MOVED:
        return importlib.import_module(f".{_MOVED.get(name, name)}", __name__)
    raise AttributeError(f"module 'polykernel' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
