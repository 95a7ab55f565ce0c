"""``patch(model, mode="inference")``'s attention: merged QKV, RoPE fused with the static KV cache's
write (one Triton launch where transformers launches rope, ``arange``, an add and two
``index_copy_``); every call it does not fuse runs transformers' forward (see :mod:`._inference`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from polykernel import env

from ._merged import QKV, merged_for_call, wants_grad


@functools.cache
def _static_cache_classes() -> tuple[type, type] | None:
    """transformers' ``Cache`` and ``StaticLayer`` where ``StaticLayer.update`` writes at its device
    counter (``arange(T) + cumulative_length``, then ``cumulative_length += T``, two
    ``index_copy_``: transformers 5.17 to 5.24 at least), the write the fused kernel makes; None
    for a transformers whose static layer works otherwise (then the attention is never fused)."""
    try:
        from transformers.cache_utils import Cache, StaticLayer
    except ImportError:
        return None
    names = set(getattr(getattr(StaticLayer.update, "__code__", None), "co_names", ()))
    if not {"cumulative_length", "index_copy_", "lazy_initialization"} <= names or not hasattr(Cache, "update"):
        return None
    return Cache, StaticLayer


def _triton_runs_on(device: torch.device) -> bool:
    return device.type == "cuda" or (device.type == "cpu" and env.triton_interpret())


def _static_layer(module: nn.Module, cache: Any, key: tuple[int, int, int, int], like: torch.Tensor) -> Any:
    """The attention's layer of ``cache`` if the fused write is its ``update``: a plain
    ``StaticLayer`` (not sliding-window, not offloaded, ``update`` not replaced) of a ``Cache``
    whose ``update`` is transformers', initialised now if it was not (as its ``update`` would),
    holding rotated k of shape ``key`` and ``like``'s dtype and device; else None."""
    classes = _static_cache_classes()
    if classes is None or not isinstance(cache, classes[0]):
        return None
    cache_class, static_layer = classes
    layers = getattr(cache, "layers", None)
    idx = getattr(module, "layer_idx", None)
    if type(cache).update is not cache_class.update or getattr(cache, "offloading", False) or not isinstance(idx, int):
        return None
    if not isinstance(layers, list) or not 0 <= idx < len(layers):
        return None
    layer = layers[idx]
    if type(layer) is not static_layer or "update" in layer.__dict__ or "lazy_initialization" in layer.__dict__:
        return None
    if not layer.is_initialized:  # what update does first, with k and v of this shape, dtype and device
        states = torch.empty(key, dtype=like.dtype, device=like.device)
        layer.lazy_initialization(states, states)
    keys, values, counter = layer.keys, layer.values, layer.cumulative_length
    b, h, _, d = key
    ok = (
        isinstance(keys, torch.Tensor)
        and isinstance(values, torch.Tensor)
        and isinstance(counter, torch.Tensor)
        and keys.dtype == values.dtype == like.dtype
        and keys.device == values.device == counter.device == like.device
        and keys.dim() == 4
        and tuple(keys.shape[:2]) == tuple(values.shape[:2]) == (b, h)
        and keys.shape[2] == values.shape[2]
        and keys.shape[3] == values.shape[3] == d
        and counter.numel() == 1
        and counter.dtype == torch.int64
    )
    return layer if ok else None


def fused_attention_forward(unfused: Callable, attention_functions: Any, default_attention: Callable | None) -> Callable:
    """Llama's attention forward for ``patch(mode="inference")`` with ``rope``: the q/k/v
    projections as one matmul on their merged weight, then one Triton launch that applies RoPE
    (``polykernel.rope``'s math) to q and k and writes k and v into the static KV cache
    (:mod:`polykernel.backends.triton.rope_kv_write`), then the attention function that
    ``unfused`` (transformers' forward on ``attention_functions``) calls, and o_proj.

    Taken for a plain decode or prefill step on a transformers ``StaticCache`` layer (see
    :func:`_static_layer`) with Llama's rotate-half tables; every other call (no cache, a
    ``DynamicCache``, a sliding-window layer, attention weights asked for, gradients wanted,
    autocast, torch.compile tracing, a device Triton cannot run on) runs ``unfused``. The result, and the
    cache after the call, are the unfused path's: the same rotation and writes (the merged matmul
    rounds as the three do up to the GEMM's own choice of kernel)."""

    @functools.wraps(unfused)
    def forward(
        self: nn.Module,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, Any]:
        fused = None if _FUSED_OFF else _fused_call(self, hidden_states, position_embeddings, args, kwargs)
        if fused is None:
            return unfused(self, hidden_states, position_embeddings, attention_mask, *args, **kwargs)
        layer, hq, hk, t, kw, merged = fused
        cos, sin = position_embeddings  # type: ignore[misc]
        qkv = F.linear(hidden_states, *merged)
        try:
            query = _rope_kv_write(qkv, hq, hk, cos, sin, layer.cumulative_length, layer.keys, layer.values)
        except Exception as exc:  # e.g. a Triton that cannot compile the kernel: before any write
            _fused_failed(exc)
            return unfused(self, hidden_states, position_embeddings, attention_mask, *args, **kwargs)
        layer.cumulative_length.add_(t)  # after the launch: its programs read the counter
        interface = attention_functions.get_interface(self.config._attn_implementation, default_attention)
        out, weights = interface(
            self,
            query,
            layer.keys,
            layer.values,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kw,
        )
        out = out.reshape(*hidden_states.shape[:-1], -1).contiguous()
        return self.o_proj(out), weights

    forward._polykernel = getattr(unfused, "_polykernel", "rope")  # type: ignore[attr-defined]
    return forward


# Set when the fused kernel failed once (logged once): every later call runs the unfused forward.
_FUSED_OFF: list[str] = []


def _fused_failed(exc: Exception) -> None:
    """The fused launch raised (a compile error is raised before anything is written): under
    ``POLYKERNEL_STRICT=1`` that is the error; else log once and run the unfused forward from now on."""
    from polykernel.core.selection.state import log_once, strict_mode

    if strict_mode() or isinstance(exc, IndexError):  # IndexError: the cache is full, as index_copy_ says
        raise exc
    _FUSED_OFF.append(f"{type(exc).__name__}: {exc}")
    log_once(
        ("inference", "rope_kv_write"),
        "polykernel: patch(mode='inference'): the fused RoPE + KV-cache write failed "
        f"({_FUSED_OFF[0].splitlines()[0][:300]}); running transformers' attention forward from now on "
        "(POLYKERNEL_STRICT=1 makes this an error)",
    )


def _rope_kv_write(*args: Any) -> torch.Tensor:
    from polykernel.backends.triton.rope_kv_write import rope_kv_write

    return rope_kv_write(*args)


def _fused_call(
    module: nn.Module, hidden: Any, position_embeddings: Any, args: tuple, kwargs: dict[str, Any]
) -> tuple[Any, int, int, int, dict[str, Any], tuple[torch.Tensor, torch.Tensor | None]] | None:
    """(the cache layer, q heads, KV heads, tokens, the attention function's kwargs, the merged QKV
    weight and bias) when this call can take the fused path, else None."""
    if args or not isinstance(hidden, torch.Tensor) or hidden.dim() != 3 or torch.compiler.is_compiling():
        return None
    if "cache" in kwargs and "past_key_values" in kwargs:
        return None
    kw = dict(kwargs)
    cache = kw.pop("cache", None) if "cache" in kw else kw.pop("past_key_values", None)
    if cache is None or kw.get("output_attentions") or not _triton_runs_on(hidden.device):
        return None
    if torch.is_autocast_enabled(hidden.device.type):  # q/k/v in the autocast dtype, the tables in the model's
        return None
    q_proj, k_proj, v_proj = module.q_proj, module.k_proj, module.v_proj
    if torch.is_grad_enabled() and wants_grad(hidden, q_proj, k_proj, v_proj):
        return None
    merged = merged_for_call(module, QKV) if "_polykernel_qkv_weight" in module.__dict__ else None  # merged at patch time
    if merged is None:
        return None
    d = getattr(module, "head_dim", None)
    if not isinstance(d, int) or d <= 0 or d % 2 or q_proj.out_features % d or k_proj.out_features % d:
        return None
    hq, hk = q_proj.out_features // d, k_proj.out_features // d
    b, t, _ = hidden.shape
    if v_proj.out_features != k_proj.out_features or q_proj.weight.dtype != hidden.dtype or q_proj.weight.device != hidden.device:
        return None
    if not (isinstance(position_embeddings, tuple) and len(position_embeddings) == 2):
        return None
    cos, sin = position_embeddings
    if not (isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor) and cos.dim() == 3 and sin.shape == cos.shape):
        return None
    if not (cos.shape[0] in (1, b) and cos.shape[1] == t and cos.shape[2] == d and cos.dtype == sin.dtype == hidden.dtype):
        return None
    if cos.device != hidden.device or sin.device != hidden.device:
        return None
    layer = _static_layer(module, cache, (b, hk, t, d), hidden)
    if layer is None:
        return None
    return layer, hq, hk, t, kw, merged
