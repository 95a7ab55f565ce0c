"""The causal-LM loss: ``cross_entropy`` on the logits, and ``fused_linear_cross_entropy`` on the
hidden states and lm_head's weight (vocab-parallel for a ``ColwiseParallel`` lm_head)."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

try:
    from transformers.loss.loss_utils import LOSS_MAPPING
except ImportError:  # transformers too old to route losses: its CausalLMs use plain cross-entropy
    LOSS_MAPPING = None

import polykernel as _pk
from polykernel import _compat

from ._families import _Family


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


def _unfused(model: nn.Module, why: str) -> None:
    """The fused loss does not apply: logged once per model class and reason (an error under
    POLYKERNEL_STRICT=1), since the memory it saves is why users patch the loss."""
    from polykernel.core.selection.state import fallback_once

    message = (
        f"polykernel: patch(): {type(model).__name__}'s {why}; its loss runs on the logits, not fused "
        "with lm_head (POLYKERNEL_STRICT=1 makes this an error)"
    )
    fallback_once(("transformers", "fused_linear_cross_entropy", type(model).__name__, why), message)


def _flce_head(model: nn.Module, family: _Family | None = None) -> nn.Linear | None:
    """lm_head when the fused loss computes exactly what it would, else None (logged once)."""
    config = getattr(model, "config", None)
    handled = (family.logit_divisor, family.logit_softcap) if family is not None else ()
    for name in _LOGIT_TRANSFORMS:
        if name not in handled and getattr(config, name, None) not in (None, 1, 1.0):
            return _unfused(model, f"config sets {name}, which the fused loss does not apply")
    cap = _logit_softcap(model, family)
    # cap - cap == 0: finite (inf - inf and NaN are NaN), also for the symbolic float Dynamo makes of the
    # config's value under dynamic=True, where math.isfinite was a graph break before the loss
    if cap is not None and not (cap > 0 and cap - cap == 0):
        return _unfused(model, f"logit softcap {cap!r} is not a positive finite number")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else getattr(model, "lm_head", None)
    if not isinstance(head, nn.Linear) or type(head).forward is not nn.Linear.forward:
        return _unfused(model, f"lm_head is a {type(head).__name__} with its own forward (quantized, LoRA, custom)")
    colwise = _colwise_input(head) is not None  # tensor parallel: the fused loss runs vocab-parallel
    if (_compat.module_hooks_seen(head) and not colwise) or hasattr(head, "_hf_hook"):
        return _unfused(model, "lm_head has hooks (accelerate offload, user hooks), which must see its call")
    if _compat.module_has_hooks(head) and not colwise:
        return _unfused(model, "lm_head's hooks cannot be read on this torch (polykernel._compat's fallback)")
    if not head.weight.is_floating_point() or head.weight.device.type == "meta":
        return _unfused(model, f"lm_head's weight is {head.weight.dtype} on {head.weight.device.type}")
    if type(head.weight).__name__ == "DTensor" and not colwise:
        return _unfused(model, "lm_head is tensor-parallel in a layout other than ColwiseParallel")
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
# Flags of a forward installed on the model before patch() wrapped it, which computes another output
# itself: TRL's add_fused_lm_head (its trainers' __init__) returns per-token log-probs for
# `fused_lm_head=True`. Such a call goes to that forward untouched.
_FORWARD_FLAGS = ("fused_lm_head",)
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
        if labels is None or len(args) > len(positional) or any(kwargs.get(flag) for flag in _FORWARD_FLAGS):
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
        if return_dict:
            return out
        if out.logits is None:  # fused: the tuple keeps logits' slot (to_tuple drops Nones) so positions match
            return (out.loss, None, *(v for k, v in out.items() if k not in ("loss", "logits")))
        return out.to_tuple()

    forward._polykernel = "loss"  # type: ignore[attr-defined]
    return forward
