"""``patch(model)``: a built model's modules patched one by one."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from functools import partial

from torch import nn

from ._attention import _attention_forward
from ._code import _CannotPatch
from ._families import SUPPORTED_MODEL_TYPES, _config_left_alone, _Family
from ._install import _LEFT_ALONE, _calls_rope, _classify, _install, _unpatch_model
from ._layers import _mlp_forward, _mlp_supported, _rms_norm_forward
from ._loss import _causal_lm_forward
from ._mask import _base_model_forward
from ._moe import _experts_factory, _experts_supported
from ._switches import _enabled, _gated_ops, _requested

logger = logging.getLogger(__package__)


# The forward makers that _install keeps, as partials of module-level functions on picklable
# arguments (a family, not its modeling module): a copy of the model makes its forwards again.
def _experts(base: Callable, layout: str) -> Callable:
    return _experts_factory(layout)(base)


def _attention(base: Callable, family: _Family, rope: bool = True, sinks: bool = False) -> Callable:
    return _attention_forward(base, importlib.import_module(family.module), family, rope, sinks)


def _base_model(base: Callable, family: _Family) -> Callable:
    return _base_model_forward(base, importlib.import_module(family.module))


def _patch_model(model: nn.Module, switches: dict[str, bool]) -> nn.Module:
    found = [(name, m, c) for name, m in model.named_modules() if (c := _classify(m)) is not None]
    if not found:
        model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        raise ValueError(
            f"polykernel.integrations.transformers.patch: {model_type!r} has no module of a supported family; "
            f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    _unpatch_model(model)
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
                _install(module, partial(_rms_norm_forward, norm=family.norm))
            elif role == "mlp" and on["swiglu"]:
                why = _mlp_supported(module)
                if why is not None:
                    logger.info("polykernel: MLP %s left as is: %s", name, why)
                    left.setdefault("swiglu", f"{type(module).__name__}: {why}")
                    continue
                _install(module, partial(_mlp_forward, ops=_gated_ops()))
            elif role == "moe_experts" and on["moe_experts"]:
                why = _experts_supported(module, family.experts)
                if why is not None:
                    logger.info("polykernel: experts %s left as is: %s", name, why)
                    left.setdefault("moe_experts", f"{type(module).__name__}: {why}")
                    continue
                _install(module, partial(_experts, layout=family.experts))
            elif role == "attention":
                rope = on["rope"] and "rope" not in family_left and _calls_rope(module)
                sinks = on["attention_sinks"] and family.attention_sinks
                if rope or sinks:
                    _install(module, partial(_attention, family=family, rope=rope, sinks=sinks))
            elif role == "base_model" and on["sdpa_is_causal"]:
                _install(module, partial(_base_model, family=family))
            elif role == "causal_lm" and use_loss:
                flce, ce = on["fused_linear_cross_entropy"], on["cross_entropy"]
                _install(module, partial(_causal_lm_forward, use_flce=flce, use_ce=ce, family=family))
        except _CannotPatch as exc:
            logger.warning("polykernel: %s (%s) left as is: %s", name or "<model>", role, exc)
    for family_left in configured.values():
        left.update(family_left)
    left = _requested(left, on)
    if left:
        model.__dict__[_LEFT_ALONE] = left
    return model
