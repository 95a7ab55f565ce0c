"""TRL integration: ``DPOTrainer`` and ``GRPOTrainer`` with their loss on polykernel's fused
LM-head losses (:func:`polykernel.fused_linear_dpo_loss`, :func:`polykernel.fused_linear_grpo_loss`).

    >>> from polykernel.integrations.trl import PolykernelDPOTrainer, PolykernelGRPOTrainer  # doctest: +SKIP
    >>> trainer = PolykernelDPOTrainer(model=model, ref_model=ref, args=DPOConfig(...),  # doctest: +SKIP
    ...                                train_dataset=ds, processing_class=tokenizer)
    >>> trainer.train()                                                                  # doctest: +SKIP

The trainers are TRL's own, with one method replaced: ``_compute_loss`` runs the model's backbone
for its last hidden states and hands them, with the ``lm_head`` weight (and bias), to the fused
loss, so neither the policy nor the reference model builds ``[tokens, vocab]`` logits for the
loss. Everything else (datasets, collation, generation and rewards for GRPO, the reference model,
PEFT adapters, logging) is TRL's. ``PolykernelDPOMixin``/``PolykernelGRPOMixin`` do the same for
a subclass of TRL's trainers of your own (put the mixin first). ``impl=`` picks the loss's impl
(``"torch"``, ``"triton"``, ``"liger"``; default: polykernel's selection).

Metrics keep TRL's names. Logged: DPO ``rewards/chosen``, ``rewards/rejected``,
``rewards/accuracies``, ``rewards/margins``, ``logps/chosen``, ``logps/rejected``,
``num_tokens``; GRPO ``kl`` (β ≠ 0), ``clip_ratio/low_mean``, ``clip_ratio/high_mean``,
``clip_ratio/region_mean``, and ``clip_ratio/low_min``/``clip_ratio/high_max`` when the batch is
on-policy (no ``old_per_token_logps``: every ratio is 1, so they are 0; off-policy they would
need per-sequence ratios the fused loss does not return); GRPO's means weigh each process by its
scored tokens, as TRL's do. Not logged, because each needs a pass
over the vocabulary that the fused loss exists to avoid: ``entropy``, ``logits/chosen``,
``logits/rejected``, ``mean_token_accuracy``.

Supported configurations (anything else raises :class:`UnsupportedTRLConfig` naming the option,
when the trainer is built, before the model or data are touched where the option is in the
config — use TRL's own trainer for those):

- DPO: ``loss_type=["sigmoid"]`` (any ``loss_weights``), or ``["sigmoid", "sft"]`` with equal
  weights (the fused loss's ``compute_nll_loss``); ``f_divergence_type="reverse_kl"``,
  ``ld_alpha=None``, ``use_weighting=False``. The reference log-probs come from
  ``precompute_ref_log_probs``, else from the reference model's (or, with PEFT, the
  adapter-disabled model's) hidden states through the same fused loss.
- GRPO: ``loss_type`` in ``grpo``, ``bnpo``, ``dr_grpo``, ``dapo``;
  ``importance_sampling_level`` ``token`` or ``sequence``; any ``beta``, ``epsilon``,
  ``epsilon_high``, ``temperature``, ``use_bias_correction_kl`` (TRL's default: the KL weighted
  by the importance ratio, which the fused loss computes too), ``cast_lm_head_to_fp32``, any
  ``num_iterations``/``steps_per_generation`` (TRL's old log-probs, dapo's normaliser);
  ``delta=None``, ``top_entropy_quantile=1.0``, no entropy bonus (``entropy_coef=0``,
  ``use_adaptive_entropy=False``), ``off_policy_mask_threshold=None``, no vLLM importance-sampling
  correction, one advantage per sequence.
- Both: text-only batches (``pixel_values`` and the like raise: vision-language models are
  untested), a plain LM head (no ``final_logit_softcapping`` or logit scaling in the config).
  MoE models add TRL's router load-balancing loss (``router_aux_loss_coef``, metric
  ``aux_loss``). Not DeepSpeed ZeRO-3 (option ``deepspeed``): it partitions the ``lm_head`` weight
  that the fused loss reads (TRL's own head gathers it).

``tests/_trl_fields.py`` classifies every field of TRL's ``DPOConfig`` and ``GRPOConfig``: no effect
on the loss, honoured (a test compares it with TRL's trainer), or refused.

Written against TRL 1.16 (the ``trl`` extra pins it): the replaced method is private in TRL, so a
TRL outside the tested range logs one warning when a trainer is built.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import logging
import types
from typing import Any

import torch

try:
    import trl  # noqa: F401  (the optional extra: fail here, with the command that installs it)
except ModuleNotFoundError as _exc:
    if _exc.name != "trl":  # trl is there but broken: its own error says why
        raise
    from polykernel.errors import missing_extra

    raise missing_extra("polykernel.integrations.trl", "trl") from None
from accelerate.utils import is_peft_model
from torch.distributed.tensor import DTensor
from trl import DPOTrainer, GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import nanmin, use_adapter

import polykernel as _pk

__all__ = [
    "TESTED_TRL",
    "PolykernelDPOMixin",
    "PolykernelDPOTrainer",
    "PolykernelGRPOMixin",
    "PolykernelGRPOTrainer",
    "UnsupportedTRLConfig",
]

logger = logging.getLogger(__name__)

TESTED_TRL = ((1, 16), (1, 17))  # [low, high) of the TRL (major, minor) this module mirrors
_HIDDEN_FLAG = "polykernel_hidden_states"
_NON_MODEL_KEYS = frozenset({"completion_mask", "ref_chosen_logps", "ref_rejected_logps"})
# Config attributes that change the logits beyond hidden @ W.T + b (TRL's fused head reads them)
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling")
_GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
_MULTIMODAL_KEYS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "image_sizes", "token_type_ids", "mm_token_type_ids")


class UnsupportedTRLConfig(ValueError):
    """A TRL option that polykernel's fused loss does not compute; ``option`` names it."""

    def __init__(self, trainer: str, option: str, message: str) -> None:
        self.option = option
        super().__init__(f"{trainer}: {option}: {message}; use TRL's own trainer for this configuration")


@functools.cache
def _warn_untested_trl() -> None:
    version = importlib.metadata.version("trl")
    major_minor = tuple(int(p) for p in version.split(".")[:2])
    if not TESTED_TRL[0] <= major_minor < TESTED_TRL[1]:
        logger.warning(
            "polykernel.integrations.trl mirrors TRL %d.%d's trainer losses; TRL %s is installed (its private loss method may differ)",
            *TESTED_TRL[0],
            version,
        )


def _require(trainer: str, ok: bool, option: str, message: str) -> None:
    if not ok:
        raise UnsupportedTRLConfig(trainer, option, message)


def _check_zero3(trainer: str) -> None:
    # ZeRO-3 leaves lm_head.weight partitioned outside its module's forward, which the fused loss
    # never calls (TRL's own head gathers it; ours would get an empty weight at the first step)
    from transformers.integrations import deepspeed

    _require(trainer, not deepspeed.is_deepspeed_zero3_enabled(), "deepspeed", "ZeRO-3 (a partitioned lm_head) is not supported")


def _check_model(trainer: str, model: Any) -> None:
    text_config = model.config.get_text_config()
    for attr in _LOGIT_TRANSFORMS:
        value = getattr(text_config, attr, None)
        _require(trainer, value is None or value == 1.0, f"config.{attr}", f"is {value!r}: the fused loss takes plain hidden @ W.T logits")


def _check_text_only(trainer: str, inputs: dict[str, Any]) -> None:
    # vision-language models' batches: untested here (their backbones, image token layouts)
    for key in _MULTIMODAL_KEYS:
        _require(trainer, inputs.get(key) is None, key, "multimodal inputs are not supported")


def _router_aux_loss(model: Any, accelerator: Any, backbone_output: Any, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """The MoE load-balancing loss as TRL's fused head computes it (Mixtral's, which every MoE
    family reuses), from the router logits the backbone returned."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func  # MoE models only: imported on use

    text_config = accelerator.unwrap_model(model).config.get_text_config()
    return load_balancing_loss_func(backbone_output.router_logits, text_config.num_experts, text_config.num_experts_per_tok, attention_mask)


def _add_hidden_states_forward(model: Any) -> None:
    """``model(..., polykernel_hidden_states=True)`` returns the backbone's output (its
    ``last_hidden_state``) instead of logits; without the flag the forward is the one TRL
    installed. The call goes through the model as wrapped (DDP, FSDP, PEFT), unlike a direct call
    of the backbone, so the wrappers' hooks run."""
    if getattr(model.forward, "_polykernel_hidden", False):
        return
    previous = model.forward

    @functools.wraps(type(model).forward)  # the signature that generate() validates its kwargs against
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not kwargs.pop(_HIDDEN_FLAG, False):
            return previous(*args, **kwargs)
        kwargs["use_cache"] = False
        return self.base_model(*args, **kwargs)

    forward._polykernel_hidden = True
    model.forward = types.MethodType(forward, model)


_MIXED_PRECISION = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _head(model: Any, accelerator: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    lm_head = accelerator.unwrap_model(model).get_output_embeddings()
    weight, bias = lm_head.weight, lm_head.bias
    if isinstance(weight, DTensor):  # FSDP2 shards the head; TRL's fused head gathers it too
        weight = weight.full_tensor()
        bias = None if bias is None else bias.full_tensor()
    return weight, bias


def _head_inputs(
    accelerator: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, fp32: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The fused loss's inputs in the dtype TRL's own LM head projects in: the autocast dtype
    under mixed precision (fp32 master weights included, as ``F.linear`` under autocast), fp32
    with ``cast_lm_head_to_fp32``, else the weight's; on the head's device (``device_map`` can
    end the backbone elsewhere). The loss's math is fp32 whatever its inputs' dtype."""
    device = weight.device.type
    if fp32:
        dtype = torch.float32
    elif torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
    else:
        dtype = _MIXED_PRECISION.get(str(accelerator.mixed_precision), weight.dtype)
    hidden = hidden.to(device=weight.device, dtype=dtype)
    return hidden, weight.to(dtype), None if bias is None else bias.to(dtype)


class PolykernelDPOMixin:
    """Replaces ``DPOTrainer._compute_loss`` with :func:`polykernel.fused_linear_dpo_loss`."""

    def __init__(self, *args: Any, impl: str | None = None, **kwargs: Any) -> None:
        _warn_untested_trl()
        name = type(self).__name__
        config = kwargs.get("args") if "args" in kwargs else (args[2] if len(args) > 2 else None)
        if config is not None:
            self._polykernel_check_config(name, config)
        super().__init__(*args, **kwargs)
        if config is None:  # TRL built its default DPOConfig
            self._polykernel_check_config(name, self.args)
        self._polykernel_impl = impl
        _check_model(name, self.model)
        _add_hidden_states_forward(self.model.get_base_model() if is_peft_model(self.model) else self.model)
        if self.ref_model is not None:  # its own config: TRL's head softcaps or scales its logits by it too
            _check_model(name, self.accelerator.unwrap_model(self.ref_model))
            _add_hidden_states_forward(self.accelerator.unwrap_model(self.ref_model))

    @staticmethod
    def _polykernel_check_config(name: str, config: Any) -> None:
        loss_types = [config.loss_type] if isinstance(config.loss_type, str) else list(config.loss_type)
        weights = list(config.loss_weights or [1.0] * len(loss_types))
        _require(
            name,
            loss_types == ["sigmoid"] or (loss_types == ["sigmoid", "sft"] and weights[0] == weights[1]),
            "loss_type",
            f"{loss_types} with loss_weights {weights}: supported are ['sigmoid'] and ['sigmoid', 'sft'] with equal weights",
        )
        _require(name, config.f_divergence_type == "reverse_kl", "f_divergence_type", f"{config.f_divergence_type!r}: only 'reverse_kl'")
        _require(name, config.ld_alpha is None, "ld_alpha", "length-desensitized DPO is not supported")
        _require(name, not config.use_weighting, "use_weighting", "WPO weighting is not supported")
        _check_zero3(name)

    def _compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool) -> Any:
        _check_text_only(type(self).__name__, inputs)
        mode = "train" if self.model.training else "eval"
        model_kwargs = {k: v for k, v in inputs.items() if k not in _NON_MODEL_KEYS}
        ref_kwargs = dict(model_kwargs)  # the reference needs no router logits (TRL drops them too)
        if self.aux_loss_enabled:
            model_kwargs["output_router_logits"] = True
        seq_len = inputs["input_ids"].size(1)
        labels = inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, -100)[:, 1:]
        loss_types = self.loss_types

        # Prompt-learning PEFT prepends virtual tokens: keep the real tokens' positions, then shift.
        # The autocast is the one accelerate wraps a prepared model's forward in (TRL's own path
        # through the reference model runs under it; the hidden-state call steps past that wrapper).
        with self.accelerator.autocast():
            backbone = model(**model_kwargs, **{_HIDDEN_FLAG: True})
        hidden = backbone.last_hidden_state[:, -seq_len:-1]
        weight, bias = _head(model, self.accelerator)
        ref: dict[str, Any] = {}
        if self.precompute_ref_logps:
            ref = {"ref_chosen_logps": inputs["ref_chosen_logps"], "ref_rejected_logps": inputs["ref_rejected_logps"]}
        else:
            with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
                if is_peft_model(self.model) and self.ref_model is None:
                    # the base model is the reference: the adapter disabled (or the initial copy "ref")
                    unwrapped = self.accelerator.unwrap_model(self.model)
                    adapter = use_adapter(unwrapped, adapter_name="ref" if "ref" in unwrapped.peft_config else None)
                    ref_model = self.model
                else:
                    adapter, ref_model = contextlib.nullcontext(), self.ref_model
                with adapter, self.accelerator.autocast():
                    ref_hidden = ref_model(**ref_kwargs, **{_HIDDEN_FLAG: True}).last_hidden_state[:, -seq_len:-1]
                    # read in the adapter's context: a head PEFT wraps (modules_to_save=["lm_head"], trainable
                    # tokens) gives the reference's weight there, the trained copy outside
                    ref_head = [None if t is None else t.detach() for t in _head(ref_model, self.accelerator)]
                ref_hidden, ref_weight, ref_bias = _head_inputs(self.accelerator, ref_hidden, *ref_head)
            ref = {"ref_hidden": ref_hidden, "ref_weight": ref_weight, "ref_bias": ref_bias}

        hidden, weight, bias = _head_inputs(self.accelerator, hidden, weight, bias)
        out = _pk.fused_linear_dpo_loss(
            hidden,
            weight,
            labels.to(weight.device),
            bias,
            **ref,
            beta=self.beta,
            compute_nll_loss="sft" in loss_types,
            impl=self._polykernel_impl,
        )
        loss = out.loss * self.loss_weights[0]
        if self.aux_loss_enabled:
            aux_loss = _router_aux_loss(model, self.accelerator, backbone, inputs.get("attention_mask"))
            loss = loss + self.router_aux_loss_coef * aux_loss
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss).mean().item())
        self._polykernel_log_dpo(mode, inputs, out)
        if return_outputs:  # TRL's behaviour: the logits for compute_metrics come from one more forward
            with torch.no_grad():
                outputs = model(**model_kwargs)
            return loss, outputs
        return loss

    def _polykernel_log_dpo(self, mode: str, inputs: dict[str, Any], out: Any) -> None:
        metrics, gather = self._metrics[mode], self.accelerator.gather
        if mode == "train":
            num_tokens = self.accelerator.gather_for_metrics(inputs["attention_mask"].sum()).sum().item()
            self._total_train_tokens += num_tokens // self._tp_size
        metrics["num_tokens"] = [self._total_train_tokens]
        chosen, rejected = out.chosen_rewards.detach(), out.rejected_rewards.detach()
        metrics["rewards/chosen"].append(gather(chosen).mean().item())
        metrics["rewards/rejected"].append(gather(rejected).mean().item())
        metrics["rewards/accuracies"].append(gather((chosen > rejected).float()).mean().item())
        metrics["rewards/margins"].append(gather(chosen - rejected).mean().item())
        metrics["logps/chosen"].append(gather(out.chosen_logps.detach()).mean().item())
        metrics["logps/rejected"].append(gather(out.rejected_logps.detach()).mean().item())


class PolykernelGRPOMixin:
    """Replaces ``GRPOTrainer._compute_loss`` with :func:`polykernel.fused_linear_grpo_loss`."""

    def __init__(self, *args: Any, impl: str | None = None, **kwargs: Any) -> None:
        _warn_untested_trl()
        name = type(self).__name__
        config = kwargs.get("args") if "args" in kwargs else (args[2] if len(args) > 2 else None)
        if config is not None:
            self._polykernel_check_config(name, config)
        super().__init__(*args, **kwargs)
        if config is None:
            self._polykernel_check_config(name, self.args)
        self._polykernel_impl = impl
        _check_model(name, self.model)
        _add_hidden_states_forward(self.model.get_base_model() if is_peft_model(self.model) else self.model)

    @staticmethod
    def _polykernel_check_config(name: str, config: Any) -> None:
        _require(name, config.loss_type in _GRPO_LOSS_TYPES, "loss_type", f"{config.loss_type!r}: supported are {list(_GRPO_LOSS_TYPES)}")
        level = config.importance_sampling_level
        _require(name, level in ("token", "sequence"), "importance_sampling_level", f"{level!r}: 'token' or 'sequence'")
        _require(name, config.delta is None, "delta", "two-sided clipping is not supported")
        _require(name, config.top_entropy_quantile == 1.0, "top_entropy_quantile", "the high-entropy token mask needs entropies")
        _require(name, config.entropy_coef == 0.0, "entropy_coef", "the entropy bonus needs entropies")
        _require(name, not config.use_adaptive_entropy, "use_adaptive_entropy", "the entropy bonus needs entropies")
        _require(name, config.off_policy_mask_threshold is None, "off_policy_mask_threshold", "the off-policy mask is not supported")
        _require(
            name,
            not (config.use_vllm and config.vllm_importance_sampling_correction),
            "vllm_importance_sampling_correction",
            "vLLM's importance-sampling correction is not supported",
        )
        _check_zero3(name)

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
        name = type(self).__name__
        _check_text_only(name, inputs)
        advantages = inputs["advantages"]
        _require(name, advantages.dim() == 1, "advantages", f"shape {tuple(advantages.shape)}: one advantage per sequence")
        completion_ids = inputs["completion_ids"]
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        mask = inputs["completion_mask"] if "tool_mask" not in inputs else inputs["completion_mask"] * inputs["tool_mask"]
        k = completion_ids.size(1)

        router = {"output_router_logits": True} if self.aux_loss_enabled else {}
        with self.accelerator.autocast():
            backbone = model(input_ids=input_ids, attention_mask=attention_mask, **router, **{_HIDDEN_FLAG: True})
        hidden = backbone.last_hidden_state[:, -k - 1 : -1]  # the positions that predict the completion tokens
        hidden, weight, bias = _head_inputs(self.accelerator, hidden, *_head(model, self.accelerator), fp32=self.args.cast_lm_head_to_fp32)
        loss, stats = _pk.fused_linear_grpo_loss(
            hidden,
            weight,
            completion_ids.to(weight.device),
            mask.to(weight.device),
            advantages.to(weight.device),
            bias,
            ref_per_token_logps=inputs.get("ref_per_token_logps") if self.beta != 0.0 else None,
            old_per_token_logps=inputs.get("old_per_token_logps"),
            beta=self.beta,
            epsilon_low=self.epsilon_low,
            epsilon_high=self.epsilon_high,
            loss_type=self.loss_type,
            importance_sampling_level=self.importance_sampling_level,
            temperature=self.temperature,
            max_completion_length=self.max_completion_length,
            use_bias_correction_kl=bool(getattr(self.args, "use_bias_correction_kl", False)),
            impl=self._polykernel_impl,
        )

        # TRL's normalisation across gradient accumulation (its loss is already the micro-batch's share)
        mode = "train" if self.model.training else "eval"
        if self.loss_type == "dapo":
            # the fused loss divides by this batch's scored tokens, TRL by the generation batch's
            normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                normalizer = normalizer * self.current_gradient_accumulation_steps / self.args.steps_per_generation
            loss = loss * mask.sum().clamp(min=1.0) / normalizer
        elif mode == "train":
            loss = loss / self.current_gradient_accumulation_steps
        if self.aux_loss_enabled:  # scaled for accumulation like the policy loss, as TRL does
            aux_loss = _router_aux_loss(model, self.accelerator, backbone, attention_mask)
            loss = loss + self.router_aux_loss_coef * aux_loss / (self.current_gradient_accumulation_steps if mode == "train" else 1.0)
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss).mean().item())
        self._polykernel_log_grpo(mode, stats, mask.to(weight.device), on_policy=inputs.get("old_per_token_logps") is None)
        return loss

    def _polykernel_log_grpo(self, mode: str, stats: Any, mask: torch.Tensor, *, on_policy: bool) -> None:
        metrics = self._metrics[mode]
        tokens = (mask != 0).sum().float()
        # a sequence-level ratio is one value per sequence: TRL counts its clipping per sequence
        units = torch.tensor(float(mask.size(0)), device=mask.device) if self.importance_sampling_level == "sequence" else tokens

        def global_mean(x: torch.Tensor, count: torch.Tensor) -> float:
            # TRL's global_masked_mean: sums and counts over all processes, 0 where nothing is scored
            # (the fused loss's mean of an empty mask is NaN; its sum is 0)
            local = torch.where(count > 0, x.detach().float().reshape(()) * count, 0.0)
            totals = self.accelerator.reduce(torch.stack([local, count]), reduction="sum")
            return (totals[0] / totals[1].clamp(min=1.0)).item()

        if self.beta != 0.0:
            metrics["kl"].append(global_mean(stats.kl, tokens))
        metrics["clip_ratio/low_mean"].append(global_mean(stats.clip_ratio_low, units))
        metrics["clip_ratio/high_mean"].append(global_mean(stats.clip_ratio_high, units))
        metrics["clip_ratio/region_mean"].append(global_mean(stats.clip_ratio_region, units))
        if on_policy:  # every ratio is exp(0) = 1: no sequence is clipped
            # TRL's per-sequence fractions: 0, NaN for a sequence with no scored token (token level)
            rows = torch.zeros(mask.size(0), device=mask.device)
            if self.importance_sampling_level == "token":
                rows = rows.masked_fill((mask != 0).sum(-1) == 0, float("nan"))
            least = nanmin(self.accelerator.gather(rows)).item()
            metrics["clip_ratio/low_min"].append(least)
            metrics["clip_ratio/high_max"].append(least)


class PolykernelDPOTrainer(PolykernelDPOMixin, DPOTrainer):
    """TRL's ``DPOTrainer`` with its loss on :func:`polykernel.fused_linear_dpo_loss`."""


class PolykernelGRPOTrainer(PolykernelGRPOMixin, GRPOTrainer):
    """TRL's ``GRPOTrainer`` with its loss on :func:`polykernel.fused_linear_grpo_loss`."""
