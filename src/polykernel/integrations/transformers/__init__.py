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
  hooked, offloaded, sharded otherwise than below), or ``fused_lm_head=True`` (the forward TRL's
  trainers install, patched over), the model's own forward runs. A
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
the originals. A copy of a patched model (``copy.deepcopy``, ``pickle``, ``torch.save``) comes
back patched the same way, with its own state (``_install._reduce``). A switch whose polykernel op is not in this build is skipped with a warning.

What polykernel cannot express exactly stays transformers' code, and :func:`patched` says why
(``{"l2_norm": "left alone: ..."}``): Llama4's weightless q/k L2 norm, a partial-rotary config of a
family whose rotary function rotates the whole head, and routed experts whose activation is not
SiLU or GELU (``moe_experts``).

Only this package imports ``transformers`` (an optional extra). Its modules, each one concern,
import one way (each only from those above it):

- ``_families``: the supported families (class names, norms, rotary layouts, experts, what stays
  transformers'); ``_switches``: the ops each switch needs;
- ``_layers`` (RMSNorm, gated MLP), ``_moe`` (routed experts), ``_rope`` (rotary functions),
  ``_code`` (function copies with other globals), ``_mask`` (the causal mask under compile),
  ``_loss`` (cross-entropy and the fused loss), ``_merged`` (gate/up and q/k/v as one matmul),
  ``_inference`` and ``_fused_attention`` (the serving forwards of ``mode="inference"``),
  ``_attention`` (the patched attention forwards);
- ``_install`` (a module's own forward, installed and restored; what runs where), ``_model``
  (``patch(model)``), ``_inference_patch`` (``patch(model, mode="inference")``), ``_classes``
  (``patch("<model_type>")``), and this module: ``patch``, ``unpatch``, ``patched``.
"""

from __future__ import annotations

import logging

try:
    import transformers  # noqa: F401  (the optional extra: fail here, with the command that installs it)
except ModuleNotFoundError as _exc:
    if _exc.name != "transformers":  # transformers is there but broken: its own error says why
        raise
    from polykernel.errors import missing_extra

    raise missing_extra("polykernel.integrations.transformers", "transformers") from None
from torch import nn

from ._classes import _CLASS_LEFT_ALONE, _CLASS_PATCHES, _patch_classes, _unpatch_classes
from ._families import _FAMILIES, SUPPORTED_MODEL_TYPES, _config_left_alone  # noqa: F401  (the private two: tests read them here)
from ._inference_patch import _patch_inference
from ._install import _LEFT_ALONE, _SAVED, _classify, _kinds, _unpatch_model
from ._model import _patch_model

__all__ = ["SUPPORTED_MODEL_TYPES", "patch", "patched", "unpatch"]

logger = logging.getLogger(__name__)

MODES = ("default", "inference")


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
    attention_sinks: bool = True,
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
    through moe_experts); their routers stay transformers'. ``attention_sinks``: gpt_oss's
    attention (a learned sink logit per head, which transformers runs eagerly) on torch's fused
    attention kernels, exact gradients included (``_sinks.py``); where they do not apply, or the
    attention weights are asked for (``output_attentions``), transformers' eager attention runs.
    Patching again re-applies with the new switches.

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
        "attention_sinks": attention_sinks,
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
        _patch_inference(model, rope)
        logger.info("polykernel: patched %s for inference: %s", type(model).__name__, {k: len(v) for k, v in patched(model).items()})
        return model
    _patch_model(model, switches)
    summary = {kind: len(names) if isinstance(names, list) else names for kind, names in patched(model).items()}
    logger.info("polykernel: patched %s: %s", type(model).__name__, summary or "nothing")
    return model


def unpatch(model: nn.Module | str) -> nn.Module | None:
    """Undo :func:`patch` (a model: its modules' own forwards; a model type: the classes).

    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, vocab_size=128)
    >>> model = patch(LlamaForCausalLM(config))
    >>> unpatch(model) is model, patched(model)
    (True, {})
    """
    if isinstance(model, str):
        _unpatch_classes(model)
        return None
    return _unpatch_model(model)


def patched(model: nn.Module | str) -> dict[str, list[str] | str]:
    """What polykernel runs in ``model``: kind (``rms_norm``, ``swiglu`` or ``geglu`` (the MLPs, by
    their activation), ``rope``, ``loss``, ``sdpa_is_causal``, ``moe_experts``, ``attention_sinks``) -> the qualified names
    of the modules that run it, whether patched one by one or by model type (a model type: the patched
    class attributes, the MLP classes under ``swiglu``). A kind the model's family has but polykernel cannot express exactly maps to
    ``"left alone: <why>"`` instead (e.g. ``{"l2_norm": "left alone: Llama4's q/k L2 norm has no weight ..."}``,
    ``{"moe_experts": "left alone: ..."}``): that part runs transformers' own code.

    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, vocab_size=128)
    >>> model = patch(LlamaForCausalLM(config))
    >>> sorted(patched(model))
    ['loss', 'rms_norm', 'rope', 'sdpa_is_causal', 'swiglu']
    >>> patched(model)["rms_norm"]
    ['model.layers.0.input_layernorm', 'model.layers.0.post_attention_layernorm', 'model.norm']
    """
    out: dict[str, list[str] | str] = {}
    if isinstance(model, str):
        for owner, attr, _ in _CLASS_PATCHES.get(model, []):
            value = getattr(owner, attr)
            kind = getattr(value, "_polykernel", None)
            if kind is not None:
                out.setdefault(kind, []).append(f"{getattr(owner, '__name__', owner)}.{attr}")  # type: ignore[union-attr]
        left = _CLASS_LEFT_ALONE.get(model, {})
    else:
        left = {}
        for name, module in model.named_modules():
            left.update(module.__dict__.get(_LEFT_ALONE, {}))  # the patched model may sit in a wrapper (PEFT's)
            kinds = _kinds(module)
            for kind in kinds:
                out.setdefault(kind, []).append(name)  # type: ignore[union-attr]
            found = _classify(module) if kinds and _SAVED not in module.__dict__ else None
            if found is not None:  # patched by model type: what that patch leaves alone
                for k, why in _CLASS_LEFT_ALONE.get(found[0].model_type, {}).items():
                    left.setdefault(k, why)
    for kind, why in left.items():
        out.setdefault(kind, f"left alone: {why}")
    return out
