"""Hugging Face ``transformers`` integration: run a model's norms, MLP activations, RoPE and loss
on polykernel's ops, in place, with the same results.

    >>> from transformers import AutoModelForCausalLM                       # doctest: +SKIP
    >>> from polykernel.integrations.transformers import patch, unpatch, patched
    >>> model = AutoModelForCausalLM.from_pretrained("meta-llama/Llama-3.2-1B")  # doctest: +SKIP
    >>> patch(model)                     # this model only                  # doctest: +SKIP
    >>> patch("llama")                   # the classes: models built from now on too  # doctest: +SKIP
    >>> patched(model)                   # {"rms_norm": [...], "swiglu": [...], ...}  # doctest: +SKIP
    >>> unpatch(model)                                                      # doctest: +SKIP

What is swapped (families: :data:`SUPPORTED_MODEL_TYPES`):

- ``rms_norm``: ``<Family>RMSNorm.forward`` -> :func:`polykernel.rms_norm`; Llama-style norms
  (``weight * x̂.to(dtype)``) use ``casting="llama"``, Gemma's ``(x̂ · (1 + w)).to(dtype)`` uses
  ``offset=1.0, casting="fp32"`` (Gemma3 too), Olmo2's, Olmo3's and gpt-oss's
  ``(w · x̂).to(dtype)`` ``casting="fp32"``. The ``q_norm``/``k_norm`` (Qwen3, Gemma3, Olmo,
  EXAONE 4) and DeepSeek-V3's latent norms are RMSNorms too.
- ``swiglu``: ``<Family>MLP.forward`` -> ``down(swiglu(gate(x), up(x)))`` when the MLP's
  activation is SiLU, ``down(geglu(gate(x), up(x), approximate))`` when it is GELU (tanh or
  exact); Phi3/GLM4's merged ``gate_up_proj`` gives the two halves' views. MoE families: the
  dense MLPs and shared experts. Any other activation is left alone.
- ``moe_experts``: the routed ``<Family>Experts.forward`` (given the router's top-k index and
  weights; the router stays transformers') -> :func:`polykernel.moe_experts` for transformers'
  layout (Qwen3-MoE, Mixtral, DeepSeek-V3, whose fp32 routing weights it takes as they are),
  :func:`polykernel.moe_experts_gpt_oss` for gpt-oss's (interleaved, transposed, biased, clamped
  SwiGLU). Llama 4's ``Llama4TextMoe.forward`` (its experts take each token scaled by its router
  score) -> the shared expert plus moe_experts on the k scaled copies of each token. Under
  autocast, or with mixed dtypes, the original runs.
- ``rope``: the rotary function that ``<Family>Attention.forward`` calls ->
  :func:`polykernel.rope`: rotate-half, gpt-oss's half-width tables (``cat((cos, cos))``) and
  DeepSeek-V3's interleaved pairs (rotate-half on ``[evens, odds]``, the layout it returns),
  Phi3's partial rotary (``rotary_dim`` = the tables' width), GLM4's partial GPT-J pairs
  (``interleaved=True``, tables as HF converts them), Llama4's complex pairs (``interleaved=True``
  with the real and imaginary parts as cos/sin), Qwen2-VL's M-RoPE (its sections arrive merged
  into plain tables) and vision rotary.
  Cases it does not cover — ``unsqueeze_dim != 1``, partial tables for a whole-head function, mixed dtypes (but
  Olmo's fp32 tables, whose function casts back to q's dtype) — go to the original function;
  NoPE layers call none.
- ``cross_entropy``: the causal-LM loss when logits are computed (eval with labels, or
  ``fused_linear_cross_entropy=False``) -> :func:`polykernel.cross_entropy`, with
  ``ForCausalLMLoss``'s shift, ``ignore_index`` and ``num_items_in_batch`` semantics.
- ``fused_linear_cross_entropy``: ``<Family>ForCausalLM.forward`` in training mode with
  ``labels`` -> hidden states from the base model, then
  :func:`polykernel.fused_linear_cross_entropy` with ``lm_head``'s weight (tied or not): the
  ``[tokens, vocab]`` logits are never materialized and ``output.logits`` is ``None``.
  Granite's ``logits_scaling`` divides the hidden states instead of the logits; Gemma 2/3's
  ``final_logit_softcapping`` is the fused loss's ``softcap``; MoE models add
  ``router_aux_loss_coef`` x the load-balancing loss as theirs do (``output_router_logits``).
  Without labels, in eval mode, with ``logits_to_keep != 0``, a custom ``loss_function``, another
  family's logit soft-capping or scaling, or an ``lm_head`` that is not a plain ``nn.Linear`` (quantized,
  hooked, offloaded, sharded otherwise than below), the model's own forward runs. A
  ``ColwiseParallel`` ``lm_head`` (``parallelize_module``, vocabulary-sharded) keeps the fused
  loss: it runs vocab-parallel on the weight's shards (docs/tensor-parallel.md).
- ``sdpa_is_causal`` (no op of ours): ``<Family>Model.forward`` builds its attention masks so
  that, under ``torch.compile``, SDPA gets ``is_causal=True`` and no mask wherever transformers
  itself skips the mask outside compile (nothing padded, plain causal, positions the model made
  itself or a cache). transformers materializes a ``[B, 1, S, S]`` mask there instead (5.17
  always; 5.24 with a torch before pytorch#176499, such as 2.11), which takes SDPA off its
  flash/GQA path.

How: an already-built model is patched per module instance (each patched module gets its own
``forward``; other models of the same class are untouched); RoPE is swapped by giving the patched
attention modules a copy of their ``forward`` whose globals see polykernel's
``apply_rotary_pos_emb`` (the modeling module itself is not changed). ``patch("<model_type>")``
instead swaps the class ``forward`` methods and the modeling module's ``apply_rotary_pos_emb``.
Calling ``patch`` again re-applies it with the new switches (idempotent); ``unpatch`` restores
the originals. A switch whose polykernel op is not in this build is skipped with a warning.

What polykernel cannot express exactly stays transformers' code, and :func:`patched` says why
(``{"l2_norm": "left alone: ..."}``): Llama4's weightless q/k L2 norm, a partial-rotary config of a
family whose rotary function rotates the whole head, and routed experts whose activation is not
SiLU or GELU (``moe_experts``).

Only this package imports ``transformers`` (an optional extra).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import logging
import math
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

try:
    import transformers  # noqa: F401  (the optional extra: fail here, with the command that installs it)
except ModuleNotFoundError as _exc:
    if _exc.name != "transformers":  # transformers is there but broken: its own error says why
        raise
    from polykernel.errors import missing_extra

    raise missing_extra("polykernel.integrations.transformers", "transformers") from None
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

try:
    from transformers.loss.loss_utils import LOSS_MAPPING
except ImportError:  # transformers too old to route losses: its CausalLMs use plain cross-entropy
    LOSS_MAPPING = None

import polykernel as _pk
from polykernel import _compat

__all__ = ["SUPPORTED_MODEL_TYPES", "patch", "patched", "unpatch"]

logger = logging.getLogger(__name__)

# switch -> the polykernel public ops it needs (the MLP switch covers both gated activations)
_SWITCH_OPS = {
    "rms_norm": ("rms_norm",),
    "swiglu": ("swiglu", "geglu"),
    "rope": ("rope",),
    "cross_entropy": ("cross_entropy",),
    "fused_linear_cross_entropy": ("fused_linear_cross_entropy",),
    "sdpa_is_causal": (),  # no polykernel op: how transformers hands the causal mask to SDPA
    "moe_experts": ("moe_experts", "moe_experts_gpt_oss"),  # transformers' Experts layout, gpt-oss's
}


# -- the supported families --------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Norm:
    """How a family's RMSNorm rounds: polykernel.rms_norm's ``offset``/``casting`` and the eps attribute."""

    offset: float
    casting: str
    eps_attr: str


_LLAMA_NORM = _Norm(offset=0.0, casting="llama", eps_attr="variance_epsilon")  # weight * x̂.to(dtype)
_GEMMA_NORM = _Norm(offset=1.0, casting="fp32", eps_attr="eps")  # (x̂ * (1 + w.float())).type_as(x)
_OLMO2_NORM = _Norm(offset=0.0, casting="fp32", eps_attr="variance_epsilon")  # (weight * x̂).to(dtype)
_LLAMA4_NORM = _Norm(offset=0.0, casting="llama", eps_attr="eps")  # x̂.type_as(x) * weight

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
# experts take every token scaled by its router score (see _llama4_moe_forward)
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


# -- op availability (ops land independently; a missing one skips its switch) ------------------
@functools.cache
def _has_op(name: str) -> bool:
    try:
        getattr(_pk, name)
    except (ImportError, AttributeError):
        return False
    return True


def _missing_ops(switch: str) -> tuple[str, ...]:
    return tuple(name for name in _SWITCH_OPS[switch] if not _has_op(name))


def _gated_ops() -> frozenset[str]:
    return frozenset(n for n in _SWITCH_OPS["swiglu"] if _has_op(n))


def _enabled(switches: dict[str, bool]) -> dict[str, bool]:
    out = {}
    for name, on in switches.items():
        missing = _missing_ops(name) if on else ()
        if on and missing and len(missing) == len(_SWITCH_OPS[name]):
            logger.warning("polykernel: %s is not available in this build; %s= is skipped", ", ".join(missing), name)
            on = False
        out[name] = bool(on)
    return out


# -- RMSNorm -----------------------------------------------------------------------------------
def _rms_norm_forward(base: Callable, norm: _Norm) -> Callable:
    offset, casting, eps_attr = norm.offset, norm.casting, norm.eps_attr

    @functools.wraps(base)
    def forward(self: nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        weight = self.weight
        # Llama's `weight * x̂.to(dtype)` promotes: an fp32 weight on bf16 x gives an fp32 result,
        # which polykernel (output dtype = x.dtype) does not; the original handles that case.
        if args or kwargs or (casting == "llama" and torch.promote_types(weight.dtype, hidden_states.dtype) != hidden_states.dtype):
            return base(self, hidden_states, *args, **kwargs)
        return _pk.rms_norm(hidden_states, weight, getattr(self, eps_attr), offset=offset, casting=casting)

    forward._polykernel = "rms_norm"  # type: ignore[attr-defined]
    return forward


# -- gated MLP ---------------------------------------------------------------------------------
def _gated_activation(act: Any) -> tuple[str, str | None] | None:
    """``("swiglu", None)`` / ``("geglu", approximate)`` for the activations polykernel fuses, else None."""
    cls = type(act)
    name = cls.__name__
    from_hf = cls.__module__ == "transformers.activations"
    if isinstance(act, nn.SiLU) or (from_hf and name == "SiLUActivation"):
        return ("swiglu", None)
    if from_hf and name in ("GELUTanh", "PytorchGELUTanh"):
        return ("geglu", "tanh")
    if from_hf and name == "GELUActivation":  # nn.functional.gelu or the erf formula: exact GELU
        return ("geglu", "none")
    if isinstance(act, nn.GELU) and act.approximate in ("none", "tanh"):
        return ("geglu", act.approximate)
    return None


def _mlp_layout(module: nn.Module) -> tuple[str, Any] | None:
    """``("split" | "merged", activation)``: ``gate_proj``/``up_proj`` or Phi3-style ``gate_up_proj``
    (gate first, then up, chunked in two), with ``down_proj``; None for any other MLP."""
    act = getattr(module, "act_fn", None)
    if act is None:
        act = getattr(module, "activation_fn", None)
    if act is None or not hasattr(module, "down_proj"):
        return None
    if hasattr(module, "gate_proj") and hasattr(module, "up_proj"):
        return "split", act
    if hasattr(module, "gate_up_proj"):
        return "merged", act
    return None


def _mlp_forward(base: Callable, ops: frozenset[str]) -> Callable:
    """``ops``: the gated activations available in this build (``swiglu``, ``geglu``)."""

    @functools.wraps(base)
    def forward(self: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        layout = _mlp_layout(self)
        kind = _gated_activation(layout[1]) if layout is not None else None
        if args or kwargs or kind is None or kind[0] not in ops:
            return base(self, x, *args, **kwargs)
        if layout[0] == "split":
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:  # views of the merged projection's two halves, as Phi3MLP.forward takes them
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        if kind[0] == "swiglu":
            return self.down_proj(_pk.swiglu(gate, up))
        return self.down_proj(_pk.geglu(gate, up, approximate=kind[1]))

    forward._polykernel = _GATED_MLP  # type: ignore[attr-defined]
    return forward


_GATED_MLP = "swiglu"  # the gated MLP forward's tag: patched() reports swiglu or geglu per module


def _mlp_supported(module: nn.Module) -> str | None:
    """Why this MLP cannot be patched, or None."""
    layout = _mlp_layout(module)
    if layout is None:
        return "it has no gate_proj/up_proj (or gate_up_proj), down_proj and act_fn"
    kind = _gated_activation(layout[1])
    if kind is None:
        return f"its activation {type(layout[1]).__name__} is not SiLU or GELU"
    if not _has_op(kind[0]):
        return f"polykernel.{kind[0]} is not available in this build"
    return None


# -- MoE experts -------------------------------------------------------------------------------
# The ``*Experts`` module gets the router's (top_k_index, top_k_weights) and returns
# Σ_j w[t, j]·expert_e(x[t]): exactly polykernel.moe_experts (transformers' layout) or
# moe_experts_gpt_oss. Their sum is in fp32 and rounded once (transformers rounds each expert's
# weighted output), the same math.
_EXPERTS_ACTIVATION = {("swiglu", None): "silu", ("geglu", "none"): "gelu", ("geglu", "tanh"): "gelu_tanh"}


def _experts_activation(module: nn.Module) -> str | None:
    kind = _gated_activation(getattr(module, "act_fn", None))
    return _EXPERTS_ACTIVATION.get(kind) if kind is not None else None


def _experts_params(module: nn.Module, layout: str) -> tuple[Any, ...]:
    if layout == _GPT_OSS_EXPERTS:
        names = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
    else:
        names = ("gate_up_proj", "down_proj")
    return tuple(getattr(module, n, None) for n in names)


def _experts_call_ok(hidden: Any, index: Any, weights: Any, params: tuple[Any, ...]) -> bool:
    """The call is one the op takes with the module's semantics: [T, H] tensors of one dtype (the
    routing weights may be fp32), no autocast (the module's matmuls would run in its dtype)."""
    if not all(isinstance(t, torch.Tensor) for t in (hidden, index, weights, *params)):
        return False
    if hidden.dim() != 2 or not hidden.is_floating_point() or torch.is_autocast_enabled(hidden.device.type):
        return False
    return all(p.dtype == hidden.dtype for p in params) and weights.dtype in (hidden.dtype, torch.float32)


def _experts_factory(layout: str) -> Callable[[Callable], Callable]:
    """The forward maker for a family's experts layout (Llama 4: its whole MoE block)."""
    if layout == _LLAMA4_EXPERTS:
        return _llama4_moe_forward
    return lambda base: _experts_forward(base, layout)


def _experts_forward(base: Callable, layout: str) -> Callable:
    @functools.wraps(base)
    def forward(self: nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        params = _experts_params(self, layout)
        # expert parallel (transformers.distributed.expert_parallel): an index equal to E marks a
        # slot routed to another rank, which transformers' code skips and moe_experts rejects
        expert_parallel = getattr(self, "_is_expert_parallel", False)
        if kwargs or len(args) != 2 or expert_parallel or not _experts_call_ok(hidden_states, args[0], args[1], params):
            return base(self, hidden_states, *args, **kwargs)
        index, weights = args
        if layout == _GPT_OSS_EXPERTS:
            return _pk.moe_experts_gpt_oss(hidden_states, index, weights, *params, alpha=self.alpha, limit=self.limit)
        activation = _experts_activation(self)
        if activation is None:
            return base(self, hidden_states, *args, **kwargs)
        return _pk.moe_experts(hidden_states, index, weights, *params, activation=activation)

    forward._polykernel = "moe_experts"  # type: ignore[attr-defined]
    return forward


def _llama4_moe_forward(base: Callable) -> Callable:
    """``Llama4TextMoe.forward``: every expert runs on every token scaled by its router score,
    ``σ(logit)`` for the top k and ``σ(-inf) = 0`` for the rest, whose expert output is then
    exactly 0 (act(0)·0 = 0, and so is its gradient). So the block is ``shared(x) + Σ_j
    expert_{e_j}(s_j·x)``: moe_experts on the k scaled copies of each token (one pair per row,
    weight 1), its weights' transposed views in transformers' layout, summed over k."""

    @functools.wraps(base)
    def forward(self: nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        experts = self.experts
        params = (experts.gate_up_proj, experts.down_proj)
        activation = _experts_activation(experts)
        x = hidden_states.reshape(-1, self.hidden_dim)
        # (the routing is not made yet: x stands in for it, checking x and the weights)
        if args or kwargs or activation is None or not _experts_call_ok(x, x, x, params):
            return base(self, hidden_states, *args, **kwargs)
        router_scores, router_logits = self.router(x)
        index = torch.topk(router_logits, self.top_k, dim=1).indices  # the router's own call: its choice
        scores = router_scores.gather(1, index)  # σ(top logits), in the logits' dtype
        t, k, h = x.shape[0], index.shape[1], x.shape[1]
        routed = (x[:, None, :] * scores[..., None]).reshape(t * k, h)  # the block's routed_in rows that are not 0
        ones = torch.ones(t * k, 1, dtype=x.dtype, device=x.device)
        out = _pk.moe_experts(routed, index.reshape(t * k, 1), ones, params[0].mT, params[1].mT, activation=activation)
        return self.shared_expert(x) + out.view(t, k, h).sum(1), router_logits

    forward._polykernel = "moe_experts"  # type: ignore[attr-defined]
    return forward


def _experts_supported(module: nn.Module, layout: str) -> str | None:
    """Why this experts module cannot be patched, or None."""
    if layout == _LLAMA4_EXPERTS:
        if not all(hasattr(module, a) for a in ("experts", "router", "shared_expert", "top_k", "hidden_dim")):
            return "it is not the router, experts and shared expert of transformers' Llama4TextMoe"
        module = module.experts
    op = "moe_experts_gpt_oss" if layout == _GPT_OSS_EXPERTS else "moe_experts"
    if not _has_op(op):
        return f"polykernel.{op} is not available in this build"
    params = _experts_params(module, layout)
    if not all(
        isinstance(p, torch.Tensor) and p.dim() == (3 if i % 2 == 0 or layout != _GPT_OSS_EXPERTS else 2) for i, p in enumerate(params)
    ):
        return "its projections are not the 3D expert tensors of transformers' layout"
    if layout == _GPT_OSS_EXPERTS:
        if not all(isinstance(getattr(module, a, None), (int, float)) for a in ("alpha", "limit")):
            return "it has no numeric alpha and limit"
        return None
    if _experts_activation(module) is None:
        return f"its activation {type(getattr(module, 'act_fn', None)).__name__} is not SiLU or GELU"
    return None


# -- RoPE --------------------------------------------------------------------------------------
def _rope_function(orig: Callable, layout: str = _ROTATE_HALF) -> Callable:
    """A drop-in for a modeling module's rotary function (``layout``: how it maps onto
    polykernel.rope) that runs polykernel.rope where it has the same semantics."""
    orig = getattr(orig, "_polykernel_orig", orig)
    try:
        extra_names = [p.name for p in inspect.signature(orig).parameters.values()][4:]
    except (TypeError, ValueError):
        extra_names = ["unsqueeze_dim"]

    if layout == _COMPLEX:
        return _complex_rope_function(orig)

    @functools.wraps(orig)
    def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *args: Any, **kwargs: Any):
        if args or kwargs:  # (DeepSeek's interleaved function takes position_ids too, and ignores them)
            extra = dict(zip(extra_names, args))
            extra.update(kwargs)
            if len(args) > len(extra_names) or extra.get("unsqueeze_dim", 1) != 1:
                return orig(q, k, cos, sin, *args, **kwargs)
        if layout == _VISION:  # [S, H, D] -> a [1, H, S, D] view, and back (the caller transposes it again)
            if not _vision_rope_supported(q, k, cos, sin):
                return orig(q, k, cos, sin, *args, **kwargs)
            q, k = _pk.rope(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), cos.unsqueeze(0), sin.unsqueeze(0))
            return q[0].transpose(0, 1), k[0].transpose(0, 1)
        tables = _rope_tables(q, k, cos, sin, layout)
        if tables is None:
            return orig(q, k, cos, sin, *args, **kwargs)
        if layout == _PAIRS:
            # DeepSeek rotates the pairs (x0, x1), (x2, x3)... and returns [evens', odds']: that is
            # rotate-half on [evens, odds] (the same products, a permutation of the input)
            q = torch.cat((q[..., 0::2], q[..., 1::2]), dim=-1)
            k = torch.cat((k[..., 0::2], k[..., 1::2]), dim=-1)
        return _pk.rope(q, k, *tables, interleaved=layout == _GLM)

    apply_rotary_pos_emb._polykernel = "rope"  # type: ignore[attr-defined]
    apply_rotary_pos_emb._polykernel_orig = orig  # type: ignore[attr-defined]
    return apply_rotary_pos_emb


def _rope_tables(q: Any, k: Any, cos: Any, sin: Any, layout: str = _ROTATE_HALF) -> tuple[torch.Tensor, torch.Tensor] | None:
    """polykernel.rope's ``[B or 1, T, D]`` cos/sin for this call, or None where it does not have the
    original's semantics. q/k ``[B, H, T, D]``; the tables of q's dtype (HF's output dtype follows
    promotion otherwise) and, as the layout takes them, of the full rotary dim D:

    - ``rotate_half``: ``[B, T, D]``, as they come;
    - ``rotate_half_cast_back`` (Olmo): the same, also fp32 tables with other q/k: the original
      computes in the promoted dtype and casts back to q's, which is polykernel.rope's math;
    - ``half_tables`` (gpt-oss): ``[B, T, D/2]``, one angle per half-pair: ``cat((cos, cos))``;
    - ``interleaved_pairs`` (DeepSeek): ``[B, T, D]`` of which the original reads the first half.
    """
    if not all(isinstance(t, torch.Tensor) for t in (q, k, cos, sin)):
        return None
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or sin.shape != cos.shape:
        return None
    b, _, t, d = q.shape
    width = d // 2 if layout == _HALF_TABLES else d
    if layout in _PARTIAL_OK and 0 < cos.shape[2] <= d and cos.shape[2] % 2 == 0:
        width = cos.shape[2]  # partial rotary: R features rotate, the rest pass through
    if not (
        k.shape[0] == b
        and k.shape[2] == t
        and k.shape[3] == d
        and cos.shape[0] in (1, b)
        and cos.shape[1] == t
        and cos.shape[2] == width
        and d > 0
        and d % 2 == 0
        and q.dtype == k.dtype
        and cos.dtype == sin.dtype
        and (cos.dtype == q.dtype or (layout == _CAST_BACK and cos.dtype == torch.float32))
    ):
        return None
    if layout == _HALF_TABLES:
        return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    if layout == _PAIRS:
        c, s = cos[..., : d // 2], sin[..., : d // 2]
        return torch.cat((c, c), dim=-1), torch.cat((s, s), dim=-1)
    if layout == _GLM:  # HF's own conversion: the first R/2 angles, each repeated for its pair
        half = width // 2
        return cos[..., :half].repeat_interleave(2, dim=-1), sin[..., :half].repeat_interleave(2, dim=-1)
    return cos, sin


def _complex_rope_function(orig: Callable) -> Callable:
    """Llama4's ``apply_rotary_emb(xq, xk, freqs_cis)``: q/k ``[B, T, H, D]`` read as complex pairs
    (x[2i], x[2i+1]) times ``freqs_cis [B, T, D/2]``, in fp32, cast back to q's dtype. That is
    polykernel.rope with ``interleaved=True`` and the real/imaginary parts, each repeated for its
    pair, as cos/sin (q/k viewed ``[B, H, T, D]``: no copy)."""

    @functools.wraps(orig)
    def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor, *args: Any, **kwargs: Any):
        if args or kwargs or not _complex_rope_supported(xq, xk, freqs_cis):
            return orig(xq, xk, freqs_cis, *args, **kwargs)
        cos = freqs_cis.real.repeat_interleave(2, dim=-1)
        sin = freqs_cis.imag.repeat_interleave(2, dim=-1)
        q, k = _pk.rope(xq.transpose(1, 2), xk.transpose(1, 2), cos, sin, interleaved=True)
        return q.transpose(1, 2), k.transpose(1, 2)

    apply_rotary_emb._polykernel = "rope"  # type: ignore[attr-defined]
    apply_rotary_emb._polykernel_orig = orig  # type: ignore[attr-defined]
    return apply_rotary_emb


def _complex_rope_supported(xq: Any, xk: Any, freqs_cis: Any) -> bool:
    if not all(isinstance(t, torch.Tensor) for t in (xq, xk, freqs_cis)):
        return False
    if xq.dim() != 4 or xk.dim() != 4 or freqs_cis.dim() != 3 or freqs_cis.dtype != torch.complex64:
        return False
    b, t, _, d = xq.shape
    return (
        xk.shape[0] == b
        and xk.shape[1] == t
        and xk.shape[3] == d
        and d > 0
        and d % 2 == 0
        and xq.dtype == xk.dtype
        and xq.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and freqs_cis.shape[0] in (1, b)
        and freqs_cis.shape[1] == t
        and freqs_cis.shape[2] == d // 2
    )


def _vision_rope_supported(q: Any, k: Any, cos: Any, sin: Any) -> bool:
    """Qwen2-VL's ``apply_rotary_pos_emb_vision``: q/k ``[S, H, D]``, cos/sin ``[S, D]``. It computes
    in fp32 and casts back, as polykernel.rope does, so fp32 tables with other q/k are the same math."""
    if not all(isinstance(t, torch.Tensor) for t in (q, k, cos, sin)):
        return False
    if q.dim() != 3 or k.dim() != 3 or cos.dim() != 2 or sin.shape != cos.shape:
        return False
    s, _, d = q.shape
    return (
        k.shape[0] == s
        and k.shape[2] == d
        and tuple(cos.shape) == (s, d)
        and d > 0
        and d % 2 == 0
        and q.dtype == k.dtype
        and cos.dtype == sin.dtype
        and cos.dtype in (q.dtype, torch.float32)
    )


class _CannotPatch(Exception):
    pass


def _global_names(code: types.CodeType) -> set[str]:
    """The globals ``code`` may read, its nested functions' included (Llama4TextModel.forward
    builds its masks in lambdas; they are made at run time with the copy's globals too)."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def _with_globals(fn: Callable, old: dict, new: dict, calls: tuple[str, ...] = ("apply_rotary_pos_emb",)) -> types.FunctionType:
    """A copy of ``fn`` whose code sees ``new`` instead of the module globals ``old``; its code
    must name one of ``calls`` (the globals the copy exists to replace).

    Decorators made with ``functools.wraps`` (``fn.__wrapped__`` held in the wrapper's closure)
    are copied too, so the copy behaves like ``fn`` in every other way.
    """
    if not isinstance(fn, types.FunctionType):
        raise _CannotPatch(f"{fn!r} is not a Python function")
    inner = fn.__dict__.get("__wrapped__")
    closure = fn.__closure__
    if inner is not None:
        new_inner = _with_globals(inner, old, new, calls)
        cells, found = [], False
        for cell in closure or ():
            try:
                held = cell.cell_contents
            except ValueError:  # empty cell
                held = None
            if held is inner:
                cells.append(types.CellType(new_inner))
                found = True
            else:
                cells.append(cell)
        if not found:
            raise _CannotPatch(f"decorator {fn.__qualname__} does not hold the function it wraps in its closure")
        closure = tuple(cells)
    elif fn.__globals__ is not old:
        raise _CannotPatch(f"{fn.__qualname__} is not defined in the modeling module")
    elif not any(name in _global_names(fn.__code__) for name in calls):
        raise _CannotPatch(f"{fn.__qualname__} does not call {' or '.join(calls)}")
    out = types.FunctionType(fn.__code__, new if fn.__globals__ is old else fn.__globals__, fn.__name__, fn.__defaults__, closure)
    out.__kwdefaults__ = fn.__kwdefaults__
    out.__dict__.update(fn.__dict__)
    out.__qualname__, out.__module__, out.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
    if inner is not None:
        out.__wrapped__ = new_inner  # type: ignore[attr-defined]
    return out


def _namespace(module_globals: dict, **overrides: Any) -> dict:
    """Globals for :func:`_with_globals`: ``module_globals`` with ``overrides``, without
    ``__name__``. torch.compile (dynamo) finds the globals of a frame through the module that
    ``__name__`` names, so it would guard on the module's own functions, not the ones the copy
    calls (and fail to build a guard where their closures differ); without it, dynamo guards on
    this dict itself."""
    ns = {**module_globals, **overrides}
    ns.pop("__name__", None)
    return ns


_ROPE_NAMESPACES: dict[str, dict] = {}


def _attention_forward(base: Callable, modeling: types.ModuleType, family: _Family) -> Callable:
    names = tuple(name for name, _ in family.rope)
    ns = _ROPE_NAMESPACES.get(modeling.__name__)
    if ns is None:
        swapped = {name: _rope_function(getattr(modeling, name), layout) for name, layout in family.rope if hasattr(modeling, name)}
        ns = _namespace(modeling.__dict__, **swapped)
        _ROPE_NAMESPACES[modeling.__name__] = ns
    forward = _with_globals(base, modeling.__dict__, ns, names)
    forward._polykernel = "rope"  # type: ignore[attr-defined]
    return forward


_INFERENCE_NAMESPACES: dict[tuple[str, bool], dict] = {}


def _inference_attention(base: Callable, modeling: types.ModuleType, family: _Family, rope: bool, fuse: bool = False) -> Callable:
    """``patch(mode="inference")``'s attention forward: transformers' own, seeing
    :class:`_inference.AttentionFunctions` (decode with shared KV heads) and, with ``rope``, the
    rotary functions on ``polykernel.rope``; with ``fuse`` (``rope`` too, q/k/v merged), that
    forward behind :func:`_inference.fused_attention_forward` (merged QKV, RoPE fused with the
    static KV cache's write), which runs it for every call it does not fuse."""
    from . import _inference

    key = (modeling.__name__, rope)
    ns = _INFERENCE_NAMESPACES.get(key)
    if ns is None:
        swapped: dict[str, Any] = {"ALL_ATTENTION_FUNCTIONS": _inference.AttentionFunctions(modeling.ALL_ATTENTION_FUNCTIONS)}
        if rope:
            swapped.update(
                {name: _rope_function(getattr(modeling, name), layout) for name, layout in family.rope if hasattr(modeling, name)}
            )
        ns = _INFERENCE_NAMESPACES[key] = _namespace(modeling.__dict__, **swapped)
    calls = ("ALL_ATTENTION_FUNCTIONS", *(name for name, _ in family.rope))
    forward = _with_globals(base, modeling.__dict__, ns, calls)
    forward._polykernel = "rope" if rope else "shared_kv_sdpa"  # type: ignore[attr-defined]
    if fuse:
        forward = _inference.fused_attention_forward(
            forward, ns["ALL_ATTENTION_FUNCTIONS"], getattr(modeling, "eager_attention_forward", None)
        )
    return forward


# -- the causal mask under torch.compile -------------------------------------------------------
# transformers lets SDPA apply causality itself (``is_causal=True``, no mask tensor) when nothing is
# padded, but only outside torch.compile: while tracing it cannot read the padding mask's values
# (5.17), and where it tries (5.24), a torch before pytorch#176499 (2.11, say) answers True to
# ``torch.compiler.is_exporting()`` under compile. So a compiled model builds a [B, 1, S, S] mask,
# SDPA leaves its GQA path (K and V repeated to every head) and cuDNN's flash backward runs with
# a bias: on the H200, issue 14's Llama spent 31-33 ms per step in attention compiled against
# 12.4 eager. Where the mask is decidable from shapes alone (no padding mask, plain causal, no
# sliding window, no static-cache offset), the patched model takes the eager route under compile.
def _no_mask_needed(kw: dict[str, Any], causal: Callable) -> bool:
    """transformers' own eager test for "SDPA's is_causal is this mask", on shapes only."""
    if kw.get("attention_mask") is not None or not kw.get("allow_is_causal_skip", True):
        return False
    if kw.get("mask_function", causal) is not causal or kw.get("local_size") is not None:
        return False
    q_offset = kw.get("q_offset", 0)
    q_length, kv_length = kw.get("q_length"), kw.get("kv_length")
    if isinstance(q_offset, torch.Tensor) or q_length is None or kv_length is None:
        return False
    return q_length == 1 or q_length == kv_length


def _sdpa_mask_function(sdpa_mask: Callable, causal: Callable) -> Callable:
    @functools.wraps(sdpa_mask)
    def sdpa_mask_is_causal(*args: Any, **kwargs: Any) -> Any:
        if not args and torch.compiler.is_compiling() and _no_mask_needed(kwargs, causal):
            return None
        return sdpa_mask(*args, **kwargs)

    return sdpa_mask_is_causal


_MASK_CREATORS: dict[tuple[int, bool], Callable] = {}  # (id(create_*_mask), drop_positions) -> copy


def _mask_creator(fn: Callable, drop_positions: bool) -> Callable:
    """A copy of a ``masking_utils.create_*mask`` function that builds SDPA masks as above.

    ``drop_positions``: the model built ``position_ids`` itself (``arange`` from the cache
    length), so they cannot describe packed sequences; transformers looks for packing in them
    anyway, and under compile, unable to read them, assumes it may be there and builds the mask.
    Not passing them on is exact then.
    """
    fn = getattr(fn, "_polykernel_orig", fn)
    made = _MASK_CREATORS.get((id(fn), drop_positions))
    if made is not None:
        return made
    masking = sys.modules[fn.__module__]
    masks = masking.AttentionMaskInterface()  # a local override: transformers' registry is untouched
    masks["sdpa"] = _sdpa_mask_function(masking.sdpa_mask, masking.causal_mask_function)
    copy = _with_globals(
        fn, masking.__dict__, _namespace(masking.__dict__, ALL_MASK_ATTENTION_FUNCTIONS=masks), ("ALL_MASK_ATTENTION_FUNCTIONS",)
    )
    if drop_positions:

        @functools.wraps(fn)
        def made(*args: Any, **kwargs: Any) -> Any:
            if "position_ids" in kwargs:
                kwargs["position_ids"] = None
            return copy(*args, **kwargs)

    else:
        made = copy
    made._polykernel_orig = fn  # type: ignore[attr-defined]
    _MASK_CREATORS[(id(fn), drop_positions)] = made
    return made


def _mask_creator_names(modeling: types.ModuleType) -> tuple[str, ...]:
    return tuple(
        name
        for name, value in vars(modeling).items()
        if name.startswith("create_")
        and name.endswith("mask")
        and getattr(getattr(value, "_polykernel_orig", value), "__module__", "") == "transformers.masking_utils"
    )


def _base_model_forward(base: Callable, modeling: types.ModuleType) -> Callable:
    """``<Family>Model.forward`` building its masks with :func:`_mask_creator`'s copies."""
    names = _mask_creator_names(modeling)
    if not names:
        raise _CannotPatch(f"{modeling.__name__} builds no mask through transformers.masking_utils")

    def copy(drop_positions: bool) -> Callable:
        creators = {n: _mask_creator(getattr(modeling, n), drop_positions) for n in names}
        return _with_globals(base, modeling.__dict__, _namespace(modeling.__dict__, **creators), names)

    with_positions, own_positions = copy(False), copy(True)
    params = list(inspect.signature(base).parameters)
    at = params.index("position_ids") - 1 if "position_ids" in params else None  # in *args (self excluded)

    @functools.wraps(base)
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("position_ids") is not None or (at is not None and len(args) > at and args[at] is not None):
            return with_positions(self, *args, **kwargs)
        return own_positions(self, *args, **kwargs)

    forward._polykernel = "sdpa_is_causal"  # type: ignore[attr-defined]
    return forward


# -- the causal-LM loss ------------------------------------------------------------------------
def _shifted_targets(labels: torch.Tensor, ignore_index: int, shift_labels: torch.Tensor | None) -> torch.Tensor:
    """ForCausalLMLoss's targets: tokens < n predict n; the last position is ignored."""
    if shift_labels is None:
        shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return shift_labels.reshape(-1)


def _reduce(loss: torch.Tensor, num_items_in_batch: Any) -> torch.Tensor:
    if num_items_in_batch is None:
        return loss
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def _ce_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    num_items_in_batch: Any = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
) -> torch.Tensor:
    target = _shifted_targets(labels, ignore_index, shift_labels).to(logits.device)
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = _pk.cross_entropy(logits.reshape(-1, logits.shape[-1]), target, ignore_index=ignore_index, reduction=reduction)
    return _reduce(loss, num_items_in_batch)


def _flce_loss(
    hidden: torch.Tensor,
    head: nn.Linear,
    labels: torch.Tensor,
    num_items_in_batch: Any = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    divisor: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """``divisor``: the logits are ``lm_head(hidden) / divisor`` (Granite's ``logits_scaling``);
    ``(hidden / divisor) @ W^T`` is the same product, so the hidden states are divided instead.
    ``softcap``: the logits are then ``softcap·tanh(logits / softcap)`` (Gemma 2/3's
    ``final_logit_softcapping``), the fused loss's own option."""
    weight, bias = head.weight, head.bias
    colwise = _colwise_input(head)
    if colwise is not None:  # vocab-parallel: hidden replicated (as the head's forward makes it)
        hidden = colwise(head, (hidden,))
    hidden = hidden.reshape(-1, hidden.shape[-1])
    if divisor is not None:
        if bias is not None:
            bias = bias / divisor
        hidden = hidden / divisor
    if hidden.dtype != weight.dtype and torch.is_autocast_enabled(hidden.device.type):
        dtype = torch.get_autocast_dtype(hidden.device.type)  # what lm_head's F.linear would run in
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    target = _shifted_targets(labels, ignore_index, shift_labels).to(hidden.device)
    reduction = "mean" if num_items_in_batch is None else "sum"
    if colwise is not None:
        from torch.distributed.tensor import DTensor, Replicate

        target = DTensor.from_local(target, weight.device_mesh, [Replicate()], run_check=False)
    loss = _pk.fused_linear_cross_entropy(hidden, weight, target, bias, ignore_index=ignore_index, reduction=reduction, softcap=softcap)
    if colwise is not None:
        loss = loss.to_local()  # the same on every rank (Replicate()), as the gathered logits' loss
    return _reduce(loss, num_items_in_batch)


def _standard_loss(model: nn.Module) -> bool:
    """The model's loss is transformers' ForCausalLMLoss (no custom ``loss_function``)."""
    if "_loss_function" in model.__dict__:
        return False
    if LOSS_MAPPING is None:
        return True
    return getattr(model, "loss_function", LOSS_MAPPING.get("ForCausalLM")) is LOSS_MAPPING.get("ForCausalLM")


_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_softcapping", "logits_scaling", "logit_scale", "output_multiplier_scale")


def _logit_divisor(model: nn.Module, family: _Family | None) -> float | None:
    """What the family divides its logits by (a config attribute it names), or None."""
    if family is None or not family.logit_divisor:
        return None
    value = getattr(getattr(model, "config", None), family.logit_divisor, None)
    return None if value in (None, 1, 1.0) else value


def _logit_softcap(model: nn.Module, family: _Family | None) -> float | None:
    """The family's final logit softcap (a config attribute it names), or None."""
    if family is None or not family.logit_softcap:
        return None
    value = getattr(getattr(model, "config", None), family.logit_softcap, None)
    return None if value is None else float(value)


def _flce_head(model: nn.Module, family: _Family | None = None) -> nn.Linear | None:
    """lm_head when the fused loss computes exactly what it would, else None."""
    config = getattr(model, "config", None)
    handled = (family.logit_divisor, family.logit_softcap) if family is not None else ()
    if any(getattr(config, name, None) not in (None, 1, 1.0) for name in _LOGIT_TRANSFORMS if name not in handled):
        return None
    cap = _logit_softcap(model, family)
    if cap is not None and not (cap > 0 and math.isfinite(cap)):
        return None  # not a softcap the op takes: the model's own loss
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else getattr(model, "lm_head", None)
    if not isinstance(head, nn.Linear) or type(head).forward is not nn.Linear.forward:
        return None  # quantized / LoRA / custom heads
    colwise = _colwise_input(head) is not None  # tensor parallel: the fused loss runs vocab-parallel
    if (_compat.module_has_hooks(head) and not colwise) or hasattr(head, "_hf_hook"):
        return None  # hooks (accelerate offload, user hooks) must see the lm_head call
    if not head.weight.is_floating_point() or head.weight.device.type == "meta":
        return None
    if type(head.weight).__name__ == "DTensor" and not colwise:
        return None  # another tensor-parallel lm_head: leave it to its own forward
    return head


def _colwise_input(head: nn.Module) -> Callable | None:
    """The input hook of a ``ColwiseParallel`` lm_head (``parallelize_module``; weight and bias
    ``Shard(0)`` on a 1-D mesh) whose only hooks are that style's, else None. The fused loss then
    runs vocab-parallel on the weight's shards (polykernel.distributed.vocab) with the hidden
    states this hook makes (``Replicate()``: the all-gather the head's forward would do), instead
    of the head's forward and its gathered ``[tokens, vocab]`` logits."""
    weight = head.weight
    if type(weight).__name__ != "DTensor" or weight.device_mesh.ndim != 1 or weight.placements[0] != _shard0():
        return None
    try:
        from torch.distributed.tensor.parallel import ColwiseParallel

        pre, post = list(head._forward_pre_hooks.values()), list(head._forward_hooks.values())
        if head._forward_pre_hooks_with_kwargs or head._forward_hooks_with_kwargs or len(pre) != 1 or len(post) != 1:
            return None
        # distribute_module's hooks are lambdas around partials of the style's static methods
        wraps = [
            {getattr(c.cell_contents, "func", None) for c in (h.__closure__ or ()) if isinstance(c.cell_contents, functools.partial)}
            for h in (pre[0], post[0])
        ]
    except Exception:  # another torch's internals: the head's own forward runs
        return None
    if ColwiseParallel._prepare_input_fn in wraps[0] and ColwiseParallel._prepare_output_fn in wraps[1]:
        return pre[0]
    return None


def _shard0() -> Any:
    from torch.distributed.tensor import Shard

    return Shard(0)


def _decoder(model: nn.Module) -> nn.Module | None:
    """The module whose first output is the hidden states lm_head reads (Llama4ForCausalLM names
    ``language_model`` as its prefix but keeps the text model in ``model``)."""
    inner = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    if not isinstance(inner, nn.Module) or inner is model:
        inner = getattr(model, "model", None)
    return inner if isinstance(inner, nn.Module) else None


_KEEP_NAMES = ("logits_to_keep", "num_logits_to_keep")
_NOT_PASSED_ON = ("loss", "logits", "aux_loss")  # output fields the fused path computes itself


def _output_class(family: _Family | None) -> type:
    """What the family's causal LM returns (MoE: router logits and the auxiliary loss too)."""
    import transformers.modeling_outputs as outputs

    return getattr(outputs, family.output, CausalLMOutputWithPast) if family is not None else CausalLMOutputWithPast


def _causal_lm_forward(base: Callable, use_flce: bool, use_ce: bool, family: _Family | None = None) -> Callable:
    sig = inspect.signature(base)  # follows __wrapped__ to the real parameters (self first)
    positional = [p.name for p in sig.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][1:]
    takes_return_dict = "return_dict" in sig.parameters
    labels_at = positional.index("labels") if "labels" in positional else None
    routed = "output_router_logits" in sig.parameters  # Mixtral, Qwen3-MoE, gpt-oss: an auxiliary loss
    out_cls = _output_class(family)
    passed_on = tuple(f.name for f in dataclasses.fields(out_cls) if f.name not in _NOT_PASSED_ON)
    modeling = sys.modules.get(family.module) if family is not None else None
    aux_loss_fn = getattr(modeling, "load_balancing_loss_func", None)

    @functools.wraps(base)
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        labels = kwargs.get("labels")
        if labels is None and labels_at is not None and len(args) > labels_at:
            labels = args[labels_at]
        if labels is None or len(args) > len(positional):
            return base(self, *args, **kwargs)  # the common inference path: untouched
        call = dict(zip(positional, args))
        if set(call) & set(kwargs):
            return base(self, *args, **kwargs)  # let the original raise its TypeError
        call.update(kwargs)
        keep = next((call[n] for n in _KEEP_NAMES if n in call), 0)
        if not (isinstance(keep, int) and keep == 0) or not _standard_loss(self):
            return base(self, *args, **kwargs)
        return_dict = call.pop("return_dict", None)
        if return_dict is None:
            return_dict = getattr(getattr(self, "config", None), "return_dict", True)
        loss_kwargs = {n: call[n] for n in ("num_items_in_batch", "ignore_index", "shift_labels") if n in call}

        head = _flce_head(self, family) if (use_flce and self.training) else None
        decoder = _decoder(self) if head is not None else None
        router_logits = False
        if routed:
            router_logits = call.get("output_router_logits")
            if router_logits is None:
                router_logits = getattr(self.config, "output_router_logits", False)
        if decoder is not None and not (router_logits and aux_loss_fn is None):
            model_kwargs = {n: v for n, v in call.items() if n not in ("labels", *_KEEP_NAMES)}
            if routed:
                model_kwargs["output_router_logits"] = router_logits
            outputs = decoder(return_dict=True, **model_kwargs)
            divisor, cap = _logit_divisor(self, family), _logit_softcap(self, family)
            loss = _flce_loss(outputs[0], head, labels, **loss_kwargs, divisor=divisor, softcap=cap)
            extra = {name: getattr(outputs, name, None) for name in passed_on}
            if router_logits:  # as the MoE causal LMs add it: coef * load-balancing loss of the routers
                aux = aux_loss_fn(outputs.router_logits, self.num_experts, self.num_experts_per_tok, call.get("attention_mask"))
                loss = loss + self.router_aux_loss_coef * aux.to(loss.device)
                extra["aux_loss"] = aux
            out = out_cls(loss=loss, logits=None, **extra)
        elif use_ce:
            call["labels"] = None
            if takes_return_dict:
                call["return_dict"] = True
            out = base(self, **call) if takes_return_dict else base(self, return_dict=True, **call)
            loss = _ce_loss(out.logits, labels, **loss_kwargs)
            aux = getattr(out, "aux_loss", None)  # computed without labels too; added to the loss with them
            if aux is not None:
                loss = loss + self.router_aux_loss_coef * aux.to(loss.device)
            out = type(out)(loss=loss, **{n: v for n, v in out.items() if n != "loss"})
        else:
            return base(self, *args, **kwargs)
        return out if return_dict else out.to_tuple()

    forward._polykernel = "loss"  # type: ignore[attr-defined]
    return forward


# -- instance patching -------------------------------------------------------------------------
_SAVED = "_polykernel_saved"  # module.__dict__ entry: (slot, previous value or None)


def _classify(module: nn.Module) -> tuple[_Family, str, type] | None:
    """The family, role and family class of ``module`` (a subclass that overrides forward: None)."""
    for cls in type(module).__mro__:
        family = _FAMILY_BY_MODULE.get(cls.__module__)
        if family is None:
            continue
        role = family.role(cls.__name__)
        if role is None:
            return None
        if type(module).forward is not cls.forward:
            return None
        return family, role, cls
    return None


def _install(module: nn.Module, make_forward: Callable[[Callable], Callable]) -> None:
    """Give ``module`` its own forward, built from the one it runs now.

    accelerate's hooks keep the real forward in ``_old_forward`` (and a wrapper in ``forward``):
    that is the slot to swap then, so the hook keeps working.
    """
    d = module.__dict__
    slot = "_old_forward" if ("_old_forward" in d and "forward" in d) else "forward"
    prev = d.get(slot)
    if prev is None:
        base = type(module).forward
    elif isinstance(prev, types.MethodType) and prev.__self__ is module:
        base = prev.__func__
    else:
        raise _CannotPatch(f"its {slot} was replaced by {prev!r}")
    d[slot] = types.MethodType(make_forward(base), module)
    d[_SAVED] = (slot, prev)


def _uninstall(module: nn.Module) -> None:
    saved = module.__dict__.pop(_SAVED, None)
    if saved is None:
        return
    slot, prev = saved
    if prev is None:
        module.__dict__.pop(slot, None)
    else:
        module.__dict__[slot] = prev


def _kind(module: nn.Module) -> str | None:
    """What polykernel runs in ``module``: its own patched forward's kind, else (``patch("<model
    type>")``) its patched class's; a gated MLP's is its activation's op (swiglu or geglu)."""
    saved = module.__dict__.get(_SAVED)
    if saved is not None:
        fn = module.__dict__.get(saved[0])
        kind = getattr(getattr(fn, "__func__", None), "_polykernel", None)
    else:
        kind = _class_kind(module)
    if kind == _GATED_MLP:  # one forward for both: the module's activation says which op runs
        layout = _mlp_layout(module)
        gated = _gated_activation(layout[1]) if layout is not None and _mlp_supported(module) is None else None
        return gated[0] if gated is not None and gated[0] in _gated_ops() else None
    return kind


def _class_kind(module: nn.Module) -> str | None:
    """The kind of a module whose family's classes ``patch("<model type>")`` patched: its class's
    forward's, or for an attention layer that calls the rotary function, ``rope`` where that
    function is patched (the class-level RoPE swap changes the modeling module, not the class)."""
    found = _classify(module)
    if found is None:
        return None
    family, role, cls = found
    if role != "attention":
        return getattr(cls.forward, "_polykernel", None)
    modeling = sys.modules.get(family.module)
    rope = any(getattr(getattr(modeling, name, None), "_polykernel", None) == "rope" for name, _ in family.rope)
    config = getattr(module, "config", None)
    if not rope or not _calls_rope(module) or (config is not None and "rope" in _config_left_alone(family, config)):
        return None
    return "rope"


_LEFT_ALONE = "_polykernel_left_alone"  # the patched model's __dict__ entry: kind -> why


def _calls_rope(attention: nn.Module) -> bool:
    """False for NoPE layers, whose forward calls no rotary function: SmolLM3's ``use_rope``
    layers and a hybrid EXAONE 4's global (non-sliding) layers."""
    if not getattr(attention, "use_rope", True):
        return False
    return getattr(attention, "sliding_window", None) is None or getattr(attention, "is_sliding", True)


def _requested(left: dict[str, str], on: dict[str, bool]) -> dict[str, str]:
    """The reasons for the kinds whose switch is on (a switch turned off leaves nothing to explain)."""
    return {kind: why for kind, why in left.items() if on.get(_LEFT_ALONE_SWITCH.get(kind, ""), True)}


def _patch_model(model: nn.Module, switches: dict[str, bool]) -> nn.Module:
    found = [(name, m, c) for name, m in model.named_modules() if (c := _classify(m)) is not None]
    if not found:
        model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        raise ValueError(
            f"polykernel.integrations.transformers.patch: {model_type!r} has no module of a supported family; "
            f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    unpatch(model)
    on = _enabled(switches)
    use_loss = on["fused_linear_cross_entropy"] or on["cross_entropy"]
    left: dict[str, str] = {}
    configured: dict[str, dict[str, str]] = {}  # model type -> what its configuration leaves alone
    for _, module, (family, _role, _) in sorted(found, key=lambda f: f[2][1] != "base_model"):  # the text model's config first
        config = getattr(module, "config", None)
        if family.model_type not in configured and config is not None:
            configured[family.model_type] = _config_left_alone(family, config)
    for name, module, (family, role, _cls) in found:
        family_left = configured.get(family.model_type, dict(family.left_alone))
        try:
            if role == "rms_norm" and on["rms_norm"]:
                _install(module, lambda base, n=family.norm: _rms_norm_forward(base, n))
            elif role == "mlp" and on["swiglu"]:
                why = _mlp_supported(module)
                if why is not None:
                    logger.info("polykernel: MLP %s left as is: %s", name, why)
                    left.setdefault("swiglu", f"{type(module).__name__}: {why}")
                    continue
                _install(module, lambda base: _mlp_forward(base, _gated_ops()))
            elif role == "moe_experts" and on["moe_experts"]:
                why = _experts_supported(module, family.experts)
                if why is not None:
                    logger.info("polykernel: experts %s left as is: %s", name, why)
                    left.setdefault("moe_experts", f"{type(module).__name__}: {why}")
                    continue
                _install(module, lambda base, lay=family.experts: _experts_factory(lay)(base))
            elif role == "attention" and on["rope"] and "rope" not in family_left and _calls_rope(module):
                modeling = sys.modules[family.module]
                _install(module, lambda base, m=modeling, f=family: _attention_forward(base, m, f))
            elif role == "base_model" and on["sdpa_is_causal"]:
                modeling = sys.modules[family.module]
                _install(module, lambda base, m=modeling: _base_model_forward(base, m))
            elif role == "causal_lm" and use_loss:
                flce, ce = on["fused_linear_cross_entropy"], on["cross_entropy"]
                _install(module, lambda base, f=flce, c=ce, fam=family: _causal_lm_forward(base, f, c, fam))
        except _CannotPatch as exc:
            logger.warning("polykernel: %s (%s) left as is: %s", name or "<model>", role, exc)
    for family_left in configured.values():
        left.update(family_left)
    left = _requested(left, on)
    if left:
        model.__dict__[_LEFT_ALONE] = left
    summary = {kind: len(names) if isinstance(names, list) else names for kind, names in patched(model).items()}
    logger.info("polykernel: patched %s: %s", type(model).__name__, summary or "nothing")
    return model


# -- inference mode (._inference) -------------------------------------------------------------
MODES = ("default", "inference")


def _patch_inference(model: nn.Module, rope: bool) -> nn.Module:
    """``patch(model, mode="inference")``: the decoder on the serving ops (see ``_inference``)."""
    from . import _inference

    bases = [(n, m, c[0]) for n, m in model.named_modules() if (c := _classify(m)) is not None and c[1] == "base_model"]
    if not bases or any(f.model_type not in _inference.FAMILIES for _, _, f in bases):
        kind = bases[0][2].model_type if bases else getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        raise ValueError(
            f"polykernel.integrations.transformers.patch: mode='inference' supports {', '.join(_inference.FAMILIES)}, not {kind!r}"
        )
    unpatch(model)
    for name, base_model, family in bases:
        layers = _inference.decoder_layers(base_model)
        if isinstance(layers, str):
            raise ValueError(f"polykernel.integrations.transformers.patch: mode='inference': {name or '<model>'}: {layers}")
        stream = _inference._Stream()
        _install(base_model, lambda b, s=stream: _inference.base_model_forward(b, s))
        _install(base_model.norm, lambda b, s=stream: _inference.final_norm_forward(b, s))
        modeling = sys.modules[family.module]
        for i, layer in enumerate(layers):
            _install(layer, lambda b, s=stream, first=i == 0: _inference.decoder_layer_forward(b, s, first))
            activation = _gated_activation(layer.mlp.act_fn) if _mlp_supported(layer.mlp) is None else None
            if activation is not None and _inference.mergeable(layer.mlp, _inference.GATE_UP) is None:
                _install(layer.mlp, lambda b, a=activation: _inference.mlp_forward(b, a))
                _inference.merge(layer.mlp, _inference.GATE_UP)
            with_rope = rope and _calls_rope(layer.self_attn)
            fuse = with_rope and _inference.mergeable(layer.self_attn, _inference.QKV) is None
            if fuse:
                _inference.merge(layer.self_attn, _inference.QKV)
            _install(layer.self_attn, lambda b, m=modeling, f=family, r=with_rope, q=fuse: _inference_attention(b, m, f, r, q))
    logger.info("polykernel: patched %s for inference: %s", type(model).__name__, {k: len(v) for k, v in patched(model).items()})
    return model


# -- class patching ----------------------------------------------------------------------------
_CLASS_PATCHES: dict[str, list[tuple[Any, str, Any]]] = {}  # model_type -> [(owner, attr, original)]
_CLASS_LEFT_ALONE: dict[str, dict[str, str]] = {}  # model_type -> kind -> why


def _patch_classes(model_type: str, switches: dict[str, bool]) -> None:
    family = _FAMILIES.get(model_type)
    if family is None:
        raise ValueError(
            f"polykernel.integrations.transformers.patch: unsupported model type {model_type!r}; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    _unpatch_classes(model_type)
    modeling = importlib.import_module(family.module)
    on = _enabled(switches)
    done: list[tuple[Any, str, Any]] = []

    def swap(owner: Any, attr: str, make: Callable[[Any], Any]) -> None:
        original = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        setattr(owner, attr, make(original))
        done.append((owner, attr, original))

    classes = {
        role: [c for n, c in vars(modeling).items() if isinstance(c, type) and c.__module__ == modeling.__name__ and family.role(n) == role]
        for role in ("rms_norm", "mlp", "causal_lm", "base_model", "moe_experts")
    }
    if on["rms_norm"]:
        for c in classes["rms_norm"]:
            swap(c, "forward", lambda f: _rms_norm_forward(f, family.norm))
    if on["swiglu"]:
        for c in classes["mlp"]:
            swap(c, "forward", lambda f: _mlp_forward(f, _gated_ops()))
    if on["moe_experts"]:  # (an unsupported call, e.g. another activation: the original runs)
        for c in classes["moe_experts"]:
            swap(c, "forward", _experts_factory(family.experts))
    if on["rope"]:  # (partial rotary dims, per call: the original function runs)
        for name, layout in family.rope:
            if hasattr(modeling, name):
                swap(modeling, name, lambda f, lay=layout: _rope_function(f, lay))
    if on["fused_linear_cross_entropy"] or on["cross_entropy"]:
        flce, ce = on["fused_linear_cross_entropy"], on["cross_entropy"]
        for c in classes["causal_lm"]:
            swap(c, "forward", lambda f: _causal_lm_forward(f, flce, ce, family))
    if on["sdpa_is_causal"]:
        for c in classes["base_model"]:
            swap(c, "forward", lambda f: _base_model_forward(f, modeling))
    _CLASS_PATCHES[model_type] = done
    _CLASS_LEFT_ALONE[model_type] = _requested(dict(family.left_alone), on)
    logger.info("polykernel: patched %s classes: %s", model_type, [f"{getattr(o, '__name__', o)}.{a}" for o, a, _ in done])


def _unpatch_classes(model_type: str) -> None:
    _CLASS_LEFT_ALONE.pop(model_type, None)
    for owner, attr, original in reversed(_CLASS_PATCHES.pop(model_type, [])):
        setattr(owner, attr, original)


# -- public API --------------------------------------------------------------------------------
def patch(
    model: nn.Module | str,
    *,
    rms_norm: bool = True,
    swiglu: bool = True,
    rope: bool = True,
    cross_entropy: bool = True,
    fused_linear_cross_entropy: bool = True,
    sdpa_is_causal: bool = True,
    moe_experts: bool = True,
    mode: str = "default",
) -> nn.Module | None:
    """Run a Hugging Face model's norms, MLP activations, RoPE and loss on polykernel's ops.

    ``model``: a built model (patched in place, per module instance; returns it), or a model type
    string such as ``"llama"`` (patches the classes, so every model of that type, built before or
    after, uses polykernel; returns None). ``swiglu`` covers the gated MLP activation (SwiGLU or
    GeGLU, whichever the model uses). ``sdpa_is_causal``: under ``torch.compile``, where nothing
    is padded, SDPA gets ``is_causal=True`` instead of a materialized ``[B, 1, S, S]`` mask, as
    transformers does outside compile (same result; keeps SDPA's flash/GQA path). ``moe_experts``:
    the routed ``*Experts`` modules (qwen3_moe, mixtral, deepseek_v3: :func:`polykernel.moe_experts`;
    gpt_oss: :func:`polykernel.moe_experts_gpt_oss`; llama4_text: its ``Llama4TextMoe`` block
    through moe_experts); their routers stay transformers'. Patching again re-applies with the
    new switches.

    ``mode="inference"`` (a built Llama): the decoder as a serving engine runs it, on the serving
    ops: the residual stream carried between layers through ``fused_add_rms_norm_``, one merged
    gate/up matmul and ``silu_and_mul``, RoPE as ``rope=`` says; the other switches do not apply
    (see :mod:`polykernel.integrations.transformers._inference`). Its norms round once (the serving op's), so
    16-bit logits differ from transformers' at that dtype's roundoff.

    >>> patch(model, rope=False)        # doctest: +SKIP
    >>> patch(model, mode="inference")  # doctest: +SKIP
    """
    if mode not in MODES:
        raise ValueError(f"polykernel.integrations.transformers.patch: mode must be one of {MODES}, got {mode!r}")
    switches = {
        "rms_norm": rms_norm,
        "swiglu": swiglu,
        "rope": rope,
        "cross_entropy": cross_entropy,
        "fused_linear_cross_entropy": fused_linear_cross_entropy,
        "sdpa_is_causal": sdpa_is_causal,
        "moe_experts": moe_experts,
    }
    if isinstance(model, str):
        if mode != "default":
            raise ValueError("polykernel.integrations.transformers.patch: mode='inference' patches a built model, not a model type")
        _patch_classes(model, switches)
        return None
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"polykernel.integrations.transformers.patch: expected a torch.nn.Module or a model type string, got {type(model).__name__}"
        )
    if mode == "inference":
        return _patch_inference(model, rope)
    return _patch_model(model, switches)


def unpatch(model: nn.Module | str) -> nn.Module | None:
    """Undo :func:`patch` (a model: its modules' own forwards; a model type: the classes)."""
    if isinstance(model, str):
        _unpatch_classes(model)
        return None
    model.__dict__.pop(_LEFT_ALONE, None)
    for module in model.modules():
        _uninstall(module)
    return model


def patched(model: nn.Module | str) -> dict[str, list[str] | str]:
    """What polykernel runs in ``model``: kind (``rms_norm``, ``swiglu`` or ``geglu`` (the MLPs, by
    their activation), ``rope``, ``loss``, ``sdpa_is_causal``, ``moe_experts``) -> the qualified names
    of the modules that run it, whether patched one by one or by model type (a model type: the patched
    class attributes, the MLP classes under ``swiglu``). A kind the model's family has but polykernel cannot express exactly maps to
    ``"left alone: <why>"`` instead (e.g. ``{"l2_norm": "left alone: Llama4's q/k L2 norm has no weight ..."}``,
    ``{"moe_experts": "left alone: ..."}``): that part runs transformers' own code."""
    out: dict[str, list[str] | str] = {}
    if isinstance(model, str):
        for owner, attr, _ in _CLASS_PATCHES.get(model, []):
            value = getattr(owner, attr)
            kind = getattr(value, "_polykernel", None)
            if kind is not None:
                out.setdefault(kind, []).append(f"{getattr(owner, '__name__', owner)}.{attr}")  # type: ignore[union-attr]
        left = _CLASS_LEFT_ALONE.get(model, {})
    else:
        left = dict(model.__dict__.get(_LEFT_ALONE, {}))
        for name, module in model.named_modules():
            kind = _kind(module)
            if kind is not None:
                out.setdefault(kind, []).append(name)  # type: ignore[union-attr]
            found = _classify(module) if kind is not None and _SAVED not in module.__dict__ else None
            if found is not None:  # patched by model type: what that patch leaves alone
                for k, why in _CLASS_LEFT_ALONE.get(found[0].model_type, {}).items():
                    left.setdefault(k, why)
    for kind, why in left.items():
        out.setdefault(kind, f"left alone: {why}")
    return out
