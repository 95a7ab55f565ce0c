"""``patch("<model_type>")``: the family's classes (and modeling module's rotary functions)
patched, so every model of that type, built before or after, runs polykernel."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import Any

from ._families import _FAMILIES, SUPPORTED_MODEL_TYPES
from ._layers import _mlp_forward, _rms_norm_forward
from ._loss import _causal_lm_forward
from ._mask import _base_model_forward
from ._moe import _experts_factory
from ._rope import _rope_function
from ._sinks import eager_with_sinks
from ._switches import _enabled, _gated_ops, _requested

logger = logging.getLogger(__package__)

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
    if on["attention_sinks"] and family.attention_sinks:
        swap(modeling, "eager_attention_forward", eager_with_sinks)
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
