"""``patch(model, mode="inference")``: a built model's decoder on the serving ops (see
:mod:`._inference`)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from functools import partial

from torch import nn

from . import _inference, _merged
from ._attention import _inference_attention
from ._families import _Family
from ._install import _calls_rope, _classify, _install, _unpatch_model
from ._layers import _gated_activation, _mlp_supported


def _attention(base: Callable, family: _Family, rope: bool, fuse: bool) -> Callable:
    """(a forward maker _install keeps: picklable, see _model)"""
    return _inference_attention(base, importlib.import_module(family.module), family, rope, fuse)


def _patch_inference(model: nn.Module, rope: bool) -> nn.Module:
    """``patch(model, mode="inference")``: the decoder on the serving ops (see ``_inference``)."""
    bases = [(n, m, c[0]) for n, m in model.named_modules() if (c := _classify(m)) is not None and c[1] == "base_model"]
    if not bases or any(f.model_type not in _inference.FAMILIES for _, _, f in bases):
        kind = bases[0][2].model_type if bases else getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        raise ValueError(
            f"polykernel.integrations.transformers.patch: mode='inference' supports {', '.join(_inference.FAMILIES)}, not {kind!r}"
        )
    _unpatch_model(model)
    for name, base_model, family in bases:
        layers = _inference.decoder_layers(base_model)
        if isinstance(layers, str):
            raise ValueError(f"polykernel.integrations.transformers.patch: mode='inference': {name or '<model>'}: {layers}")
        stream = _inference._Stream()
        _install(base_model.norm, partial(_inference.final_norm_forward, stream=stream))
        for i, layer in enumerate(layers):
            _install(layer, partial(_inference.decoder_layer_forward, stream=stream, first=i == 0))
            activation = _gated_activation(layer.mlp.act_fn) if _mlp_supported(layer.mlp) is None else None
            if activation is not None and _merged.mergeable(layer.mlp, _merged.GATE_UP) is None:
                _install(layer.mlp, partial(_inference.mlp_forward, activation=activation, act_fn=layer.mlp.act_fn))
                _merged.merge(layer.mlp, _merged.GATE_UP)
            with_rope = rope and _calls_rope(layer.self_attn)
            fuse = with_rope and _merged.mergeable(layer.self_attn, _merged.QKV) is None
            if fuse:
                _merged.merge(layer.self_attn, _merged.QKV)
            _install(layer.self_attn, partial(_attention, family=family, rope=with_rope, fuse=fuse))
        # Last: the stream starts only once every layer carries it. A forward (another thread's)
        # that met a patched base model before its later layers were patched would hand them the
        # MLP output without the residual.
        _install(base_model, partial(_inference.base_model_forward, stream=stream))
    return model
