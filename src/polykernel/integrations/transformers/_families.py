"""The supported families: how each one's modeling module names its classes, how its RMSNorm
rounds, which rotary functions it has and how they map onto polykernel.rope, its experts' layout,
and what polykernel leaves to transformers' own code."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class _Norm:
    """How a family's RMSNorm rounds: polykernel.rms_norm's ``offset``/``casting`` and the eps attribute
    (the one the family used when written; transformers renames it at times, see ``eps_of``)."""

    offset: float
    casting: str
    eps_attr: str

    def eps_of(self, module: Any) -> float | None:
        """The module's epsilon: under ``eps_attr`` (one attribute read per call), else under the other
        name transformers has used (Llama 4's RMSNorm had ``eps`` before transformers 5.25); None when
        it has neither."""
        eps = getattr(module, self.eps_attr, None)
        if type(eps) is float:
            return eps
        for name in _EPS_NAMES:
            eps = getattr(module, name, None)
            if isinstance(eps, (float, int)):
                return float(eps)
        return None


_EPS_NAMES = ("variance_epsilon", "eps")


_LLAMA_NORM = _Norm(offset=0.0, casting="llama", eps_attr="variance_epsilon")  # weight * x̂.to(dtype)
_GEMMA_NORM = _Norm(offset=1.0, casting="fp32", eps_attr="eps")  # (x̂ * (1 + w.float())).type_as(x)
_OLMO2_NORM = _Norm(offset=0.0, casting="fp32", eps_attr="variance_epsilon")  # (weight * x̂).to(dtype)
_LLAMA4_NORM = _Norm(offset=0.0, casting="llama", eps_attr="variance_epsilon")  # x̂.type_as(x) * weight

# How a family's rotary function maps onto polykernel.rope (which takes [B, T, D] rotate-half tables):
_ROTATE_HALF = "rotate_half"  # q·cos + rotate_half(q)·sin, the tables as they come
_CAST_BACK = "rotate_half_cast_back"  # Olmo: the same in the promoted dtype, cast back to q's (fp32 tables)
_HALF_TABLES = "half_tables"  # gpt-oss: [B, T, D/2] tables applied to the halves (rotate-half math)
_PAIRS = "interleaved_pairs"  # DeepSeek's pairs (x0, x1), (x2, x3)... out in rotate-half layout
_PARTIAL = "rotate_half_partial"  # Phi3: [B, T, R] tables rotate the first R features, the rest pass
_GLM = "interleaved_partial"  # GLM4: GPT-J pairs over the first R features, angles from the tables' first half
_COMPLEX = "complex_pairs"  # Llama4: q/k [B, T, H, D] as complex pairs times freqs_cis [B, T, D/2]
_PARTIAL_OK = frozenset({_PARTIAL, _GLM})  # layouts whose functions take partial rotary tables
_VISION = "vision"  # Qwen2-VL's vision tower: q/k [S, H, D], tables [S, D], fp32 math

# How a family's routed experts map onto polykernel (the ``*Experts`` module's forward, given the
# router's top-k index and weights; the router itself stays transformers'):
_HF_EXPERTS = "hf"  # gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]: moe_experts
_GPT_OSS_EXPERTS = "gpt_oss"  # interleaved, transposed, biased, clamped SwiGLU: moe_experts_gpt_oss
# Llama 4: the whole <prefix>Moe block (router, experts, shared expert) is patched, since its
# experts take every token scaled by its router score (see _moe._llama4_moe_forward)
_LLAMA4_EXPERTS = "llama4"


@dataclasses.dataclass(frozen=True)
class _Family:
    model_type: str  # config.model_type
    prefix: str  # class-name prefix in the modeling module
    norm: _Norm
    package: str = ""  # transformers.models.<package>, where it is not the model type
    roles: tuple[tuple[str, str | None], ...] = ()  # class name -> role, beyond (or instead of) the prefix names
    rope: tuple[tuple[str, str], ...] = (("apply_rotary_pos_emb", _ROTATE_HALF),)  # rotary function -> layout; () = left alone
    left_alone: tuple[tuple[str, str], ...] = ()  # kind -> why polykernel cannot express it (yet)
    output: str = "CausalLMOutputWithPast"  # what the causal LM returns (transformers.modeling_outputs)
    logit_divisor: str = ""  # config attribute the logits are divided by (the fused loss divides the hidden states)
    experts: str = ""  # the <prefix>Experts layout (_HF_EXPERTS, _GPT_OSS_EXPERTS; _LLAMA4_EXPERTS: <prefix>Moe); "" = none
    logit_softcap: str = ""  # config attribute of cap·tanh(logits / cap) on the logits (the fused loss's softcap)
    attention_sinks: bool = False  # its eager_attention_forward has sinks (gpt_oss): _sinks.eager_with_sinks runs it

    @property
    def module(self) -> str:
        package = self.package or self.model_type
        return f"transformers.models.{package}.modeling_{package}"

    def role(self, class_name: str) -> str | None:
        roles: dict[str, str | None] = {
            f"{self.prefix}RMSNorm": "rms_norm",
            f"{self.prefix}MLP": "mlp",
            f"{self.prefix}Attention": "attention",
            f"{self.prefix}ForCausalLM": "causal_lm",
            f"{self.prefix}Model": "base_model",
        }
        if self.experts == _LLAMA4_EXPERTS:
            roles[f"{self.prefix}Moe"] = "moe_experts"
        elif self.experts:
            roles[f"{self.prefix}Experts"] = "moe_experts"
        roles.update(self.roles)
        return roles.get(class_name)


_FAMILIES: dict[str, _Family] = {
    f.model_type: f
    for f in (
        _Family("llama", "Llama", _LLAMA_NORM),
        _Family("mistral", "Mistral", _LLAMA_NORM),
        _Family("qwen2", "Qwen2", _LLAMA_NORM),
        _Family("qwen3", "Qwen3", _LLAMA_NORM),
        _Family("gemma", "Gemma", _GEMMA_NORM),
        _Family("gemma2", "Gemma2", _GEMMA_NORM, logit_softcap="final_logit_softcapping"),  # the fused loss's softcap
        _Family("olmo2", "Olmo2", _OLMO2_NORM, rope=(("apply_rotary_pos_emb", _CAST_BACK),)),
        # (1 + w) norms, q/k norms included; Gemma3Model is the multimodal wrapper, not the text model
        _Family(
            "gemma3_text",
            "Gemma3",
            _GEMMA_NORM,
            package="gemma3",
            roles=(("Gemma3TextModel", "base_model"), ("Gemma3Model", None)),
            logit_softcap="final_logit_softcapping",
        ),
        _Family("qwen3_moe", "Qwen3Moe", _LLAMA_NORM, experts=_HF_EXPERTS, output="MoeCausalLMOutputWithPast"),
        _Family("mixtral", "Mixtral", _LLAMA_NORM, experts=_HF_EXPERTS, output="MoeCausalLMOutputWithPast"),
        _Family(
            "gpt_oss",
            "GptOss",
            _OLMO2_NORM,
            roles=(("GptOssMLP", None),),  # the router and experts, no dense MLP
            rope=(("apply_rotary_pos_emb", _HALF_TABLES),),
            experts=_GPT_OSS_EXPERTS,
            output="MoeCausalLMOutputWithPast",
            attention_sinks=True,  # transformers runs it eagerly (no SDPA for sinks)
        ),
        _Family("phi3", "Phi3", _LLAMA_NORM, rope=(("apply_rotary_pos_emb", _PARTIAL),)),  # merged gate_up_proj; partial rotary
        # embedding/residual/attention multipliers live in forwards the patch keeps as they are
        _Family("granite", "Granite", _LLAMA_NORM, logit_divisor="logits_scaling"),
        _Family(
            "glm4",
            "Glm4",
            _LLAMA_NORM,
            rope=(("apply_rotary_pos_emb", _GLM),),  # interleaved and partial (partial_rotary_factor 0.5)
        ),
        _Family("smollm3", "SmolLM3", _LLAMA_NORM),  # NoPE layers: their attention calls no rotary function
        _Family("olmo3", "Olmo3", _OLMO2_NORM, rope=(("apply_rotary_pos_emb", _CAST_BACK),)),
        _Family("ministral", "Ministral", _LLAMA_NORM),
        _Family("exaone4", "Exaone4", _LLAMA_NORM),
        _Family(
            "deepseek_v3",
            "DeepseekV3",
            _LLAMA_NORM,  # the dense MLPs and each MoE layer's shared experts are DeepseekV3MLP
            rope=(("apply_rotary_pos_emb", _ROTATE_HALF), ("apply_rotary_pos_emb_interleave", _PAIRS)),
            experts=_HF_EXPERTS,  # fp32 routing weights (its sigmoid router, scaled): moe_experts takes them
            output="MoeCausalLMOutputWithPast",
        ),
        # The language model. M-RoPE's sections are merged into plain [B, T, D] tables by the rotary
        # embedding module (transformers 5.24), so the attention's rotary is rotate-half. Vision
        # tower: its rotary (and, Qwen2.5-VL, its RMSNorms and gated MLPs); 2-VL's LayerNorms and
        # ungated MLPs are not ours
        _Family(
            "qwen2_vl",
            "Qwen2VL",
            _LLAMA_NORM,
            roles=(
                ("Qwen2MLP", "mlp"),
                ("VisionAttention", "attention"),
                ("Qwen2VLForConditionalGeneration", "causal_lm"),
                ("Qwen2VLTextModel", "base_model"),
                ("Qwen2VLModel", None),
            ),
            rope=(("apply_rotary_pos_emb", _ROTATE_HALF), ("apply_rotary_pos_emb_vision", _VISION)),
            left_alone=(("vision_mlp", "Qwen2-VL's vision MLP is not gated (fc1, QuickGELU, fc2) and its norms are nn.LayerNorm"),),
            output="MultimodalCausalLMOutputWithPast",
        ),
        _Family(
            "qwen2_5_vl",
            "Qwen2_5_VL",
            _LLAMA_NORM,
            roles=(
                ("Qwen2MLP", "mlp"),
                ("Qwen2_5_VLVisionAttention", "attention"),
                ("Qwen2_5_VLForConditionalGeneration", "causal_lm"),
                ("Qwen2_5_VLTextModel", "base_model"),
                ("Qwen2_5_VLModel", None),
            ),
            rope=(("apply_rotary_pos_emb", _ROTATE_HALF), ("apply_rotary_pos_emb_vision", _VISION)),
            output="MultimodalCausalLMOutputWithPast",
        ),
        _Family(
            "llama4_text",
            "Llama4Text",
            _LLAMA4_NORM,
            package="llama4",
            roles=(("Llama4ForCausalLM", "causal_lm"),),  # Llama4TextMLP: the dense layers and shared experts
            rope=(("apply_rotary_emb", _COMPLEX),),  # complex pairs: interleaved rope, q/k [B, T, H, D]
            left_alone=(("l2_norm", "Llama4's q/k L2 norm has no weight: polykernel.rms_norm needs one"),),
            experts=_LLAMA4_EXPERTS,
            output="MoeCausalLMOutputWithPast",
        ),
    )
}
_FAMILY_BY_MODULE = {f.module: f for f in _FAMILIES.values()}
SUPPORTED_MODEL_TYPES = tuple(_FAMILIES)

# a kind left alone -> the switch that would patch it
_LEFT_ALONE_SWITCH = {"rope": "rope", "l2_norm": "rms_norm", "swiglu": "swiglu", "vision_mlp": "swiglu", "moe_experts": "moe_experts"}


def _config_left_alone(family: _Family, config: Any) -> dict[str, str]:
    """kind -> why: what this family, in this configuration, leaves to transformers."""
    out = dict(family.left_alone)
    if getattr(config, "use_qk_norm", True) is False:  # Llama 4 without q/k norms (Maverick): no L2 norm to leave
        out.pop("l2_norm", None)
    params = getattr(config, "rope_parameters", None)
    factor = params.get("partial_rotary_factor") if isinstance(params, dict) else None
    if factor is None:
        factor = getattr(config, "partial_rotary_factor", 1.0)
    partial_ok = all(layout in _PARTIAL_OK for _, layout in family.rope)
    if family.rope and not partial_ok and isinstance(factor, (int, float)) and factor < 1:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        out["rope"] = (
            f"partial rotary (rotary_dim={int(head_dim * factor)} of head_dim {head_dim}): this family's rotary function "
            "rotates the whole head, so its own code runs"
        )
    return out
