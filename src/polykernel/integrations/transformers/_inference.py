"""``patch(model, mode="inference")``: a transformers Llama's decoder on the serving ops, as an
engine runs it (vLLM's and SGLang's decoder layers).

- **Residual stream, carried** (``fused_add_rms_norm_``): each decoder layer returns its MLP's
  output and leaves the residual stream to the next, whose input norm adds and normalises in one
  in-place call; the post-attention norm does the same within the layer, and the model's final
  norm closes the stream. Three residual adds and three norms per layer become two launches.
  Each forward first checks that its layers, in their order now, and its final norm still carry
  its stream; where one does not (replaced, copied, unpatched, or patched again as part of another
  model that shares it), the model's own forwards run, logged once.
- **Merged gate/up** (``silu_and_mul`` / ``gelu_and_mul``; :mod:`._merged`): the MLP's gate and
  up weights are concatenated once into one ``[2I, H]`` weight (the two projections' weights
  become views of it, so no memory is added), one matmul, then the merged-layout activation.
- **RoPE**: the attention's ``apply_rotary_pos_emb`` runs ``polykernel.rope`` (as ``patch``'s
  default mode does).
- **Merged QKV, RoPE fused with the KV-cache write** (:mod:`._fused_attention`): the q/k/v
  weights merged as gate/up are (one matmul), then one Triton launch rotates q and k and writes k
  and v into a ``StaticCache`` layer at its counter (where transformers launches rope, ``arange``,
  an add and two ``index_copy_``); any other cache or call runs the forward above.
- **Decode attention with shared KV heads** (:func:`shared_kv_sdpa`): a decode step (one query
  per sequence, a mask) of a grouped-query model runs SDPA on each KV head's group of query heads
  as that head's queries, where transformers' SDPA path (5.17) first copies K and V to every query
  head (``repeat_kv``): with a ``StaticCache`` that is the whole cache, twice, per layer and step.
  The same attention, computed without the copy.

The KV cache, masks and attention stay transformers' code: a ``StaticCache`` makes the decode
step CUDA-graph capturable (nothing here allocates outside the caching allocator or syncs).

Under ``torch.compile`` (``fullgraph=True`` holds: one graph, prefill and decode, with a
``StaticCache`` or without) the carried stream, the merged-layout activation and rope stay (the
serving ops are custom ops), but nothing merged is trusted: whether the projections still view
their merged weight is a data-pointer test Dynamo cannot trace, and no guard of Dynamo's sees
every way they stop (``load_state_dict(assign=True)`` of same-shaped weights), so each projection
runs as its own module (its weight, hooks, wrappers) and its outputs are concatenated for the
activation (:func:`._merged._projected`; the fused QKV + cache write is not traced either). The decode
mask is left boolean for SDPA (no per-forward token: Dynamo traces no ``ContextVar.set``).

Semantics: the norms are the serving op's (sum rounded to the model's dtype as transformers rounds
``residual + hidden``, then normalised in fp32 and rounded once); Llama's own norm rounds x̂ to the
dtype before the weight multiply, so in 16-bit the logits differ at that dtype's roundoff (in fp32
they agree to fp32 roundoff). Inference only: with gradients wanted (grad enabled and any weight or
input that requires grad), under ``torch.autocast`` (the stream and the projections' outputs are
then of two dtypes), or when the caller asks for every layer's hidden states (the carried layers
return the MLP's output, not the stream), the model's own forwards run; so do an MLP's and an
attention's whose projections were wrapped (PEFT's LoRA) or hooked after the patch, and an MLP's
whose ``act_fn`` was hooked or replaced (logged once).
"""

from __future__ import annotations

import functools
import threading
import types
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import polykernel as _pk
from polykernel import _compat

from ._layers import _fallback_once
from ._merged import GATE_UP, _projected, merged_for_call, wants_grad

_compiling = torch.compiler.is_compiling

# The families whose decoder layer is Llama's (input norm, attention, post-attention norm, MLP;
# residual adds around both), by model type. Only the tested one.
FAMILIES = ("llama",)


class _Forward:
    """One forward of a patched base model and its cache (``mask``: shared_kv_sdpa's), held by ``_FORWARD`` alone."""

    __slots__ = ("mask",)

    def __init__(self) -> None:
        self.mask: tuple[torch.Tensor, torch.dtype, torch.Tensor] | None = None  # (mask, dtype, additive)


# The patched base model's forward in progress (a fresh token per forward, None outside one).
_FORWARD: ContextVar[_Forward | None] = ContextVar("polykernel_inference_forward", default=None)


class _Stream(threading.local):
    """The residual stream between a patched model's layers during one forward. Per thread:
    several threads may run one model's forwards at once (a server's pool), each its own stream."""

    def __init__(self) -> None:
        self.active = False
        self.residual: torch.Tensor | None = None

    def __reduce_ex__(self, protocol: object) -> tuple[type, tuple[()]]:
        # A copy of a patched model (deepcopy, pickle) gets a new stream, which its modules
        # share (the copy's memo): the state is one forward's, never copied.
        return (_Stream, ())


def _norm_args(norm: nn.Module) -> tuple[torch.Tensor, float]:
    return norm.weight, norm.variance_epsilon


def base_model_forward(base: Callable, stream: _Stream) -> Callable:
    """The base model's forward: carries the stream when nothing asks for per-layer outputs."""

    @functools.wraps(base)
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        # any weight that trains (frozen embeddings, a LoRA-style subset) or inputs_embeds that do:
        # the serving ops write in place and run on detached merged weights
        wants_grad = torch.is_grad_enabled() and (
            any(p.requires_grad for p in self.parameters())
            or any(isinstance(t, torch.Tensor) and t.requires_grad for t in (*args, *kwargs.values()))
        )
        hidden = kwargs.get("output_hidden_states")
        per_layer = hidden if hidden is not None else getattr(self.config, "output_hidden_states", False)
        # under autocast the projections' outputs are in the autocast dtype and the residual stream
        # in the model's: the serving norms take one dtype for both, so the model's own forwards run
        autocast = torch.is_autocast_enabled(self.embed_tokens.weight.device.type)
        active = not (wants_grad or per_layer or autocast)
        if active and not _chain_whole(self, stream):
            _fallback_once(type(self).__name__, _CHAIN_BROKEN, "inference_stream")
            active = False
        stream.active, stream.residual = active, None
        # Dynamo traces neither a new token nor ContextVar.set: under torch.compile no forward token is
        # set, and shared_kv_sdpa leaves the boolean mask to SDPA (each layer's conversion is in the graph)
        token = None if _compiling() else _FORWARD.set(_Forward())
        try:
            return base(self, *args, **kwargs)
        finally:
            stream.active, stream.residual = False, None
            if token is not None:
                _FORWARD.reset(token)

    forward._polykernel = "decode_stream"  # type: ignore[attr-defined]
    return forward


_CHAIN_BROKEN = (
    "has decoder layers that no longer carry its residual stream (a layer replaced, copied, unpatched, or "
    "patched again as part of another model that shares it; patch(model, mode='inference') again to carry it)"
)


def _on_stream(module: nn.Module, stream: _Stream, place: str) -> bool:
    """Whether ``module`` runs the forward that takes part in ``stream`` at ``place`` (``first``
    layer, a later ``layer``, the final ``norm``); under an accelerate hook it is in ``_old_forward``."""
    d = module.__dict__
    for slot in ("forward", "_old_forward"):
        fn = d.get(slot)
        if not isinstance(fn, types.MethodType):
            continue
        # the tag through the bound method (it reads its function's attributes): under torch 2.11's
        # Dynamo, getattr(fn, "__func__", None) gave None (benchmarks/models/chain_under_compile.py)
        tag = getattr(fn, "_polykernel_stream", None)
        if tag is not None and fn.__self__ is module:
            return tag[0] is stream and tag[1] == place
    return False


def _chain_whole(base_model: nn.Module, stream: _Stream) -> bool:
    """Whether every decoder layer and the final norm, in their order now, carry ``stream``: each
    layer hands the next its MLP output alone (the residual in ``stream``), which a layer out of
    the chain would take as the whole hidden state."""
    layers = base_model.layers
    if not len(layers) or not _on_stream(base_model.norm, stream, "norm"):
        return False
    return all(_on_stream(layer, stream, "layer" if i else "first") for i, layer in enumerate(layers))


def _closed(hidden_states: torch.Tensor, stream: _Stream) -> torch.Tensor:
    """The stream itself, for a module that runs its own forward: a pending residual (the previous
    layer carried it) added to the MLP output the previous layer returned."""
    residual, stream.residual = stream.residual, None
    return hidden_states if residual is None else residual + hidden_states


def decoder_layer_forward(base: Callable, stream: _Stream, first: bool) -> Callable:
    """A decoder layer that takes the previous layer's MLP output (``first``: the embeddings) and
    hands its own MLP output on, the stream carried in ``stream``."""

    @functools.wraps(base)
    def forward(self: nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not stream.active or args or (not first and stream.residual is None):
            return base(self, _closed(hidden_states, stream), *args, **kwargs)
        w, eps = _norm_args(self.input_layernorm)
        if first:  # the stream starts as a copy of the embeddings (the caller's inputs_embeds stay as they are)
            residual = hidden_states.clone()
            x = _pk.rms_norm(hidden_states, w, eps)
        else:
            x, residual = _pk.fused_add_rms_norm_(hidden_states, stream.residual, w, eps)
        attn, _ = self.self_attn(hidden_states=x, **kwargs)
        w, eps = _norm_args(self.post_attention_layernorm)
        x, residual = _pk.fused_add_rms_norm_(attn, residual, w, eps)
        stream.residual = residual
        return self.mlp(x)

    forward._polykernel = "fused_add_rms_norm_"  # type: ignore[attr-defined]
    forward._polykernel_stream = (stream, "first" if first else "layer")  # type: ignore[attr-defined]
    return forward


def final_norm_forward(base: Callable, stream: _Stream) -> Callable:
    """The model's last norm: closes the stream (adds the last MLP output, normalises)."""

    @functools.wraps(base)
    def forward(self: nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        residual = stream.residual
        if not stream.active or residual is None or args or kwargs:
            return base(self, _closed(hidden_states, stream), *args, **kwargs)
        stream.residual = None
        return _pk.fused_add_rms_norm_(hidden_states, residual, self.weight, self.variance_epsilon)[0]

    forward._polykernel = "fused_add_rms_norm_"  # type: ignore[attr-defined]
    forward._polykernel_stream = (stream, "norm")  # type: ignore[attr-defined]
    return forward


def mlp_forward(base: Callable, activation: tuple[str, str | None], act_fn: nn.Module) -> Callable:
    """The MLP as one gate/up matmul, the merged-layout activation, the down projection.
    ``act_fn``: the module's activation at patch time, which ``activation`` describes; replaced or
    hooked since, the module's own forward runs (logged once), since the fused activation would
    skip it."""

    @functools.wraps(base)
    def forward(self: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args or kwargs or (torch.is_grad_enabled() and wants_grad(x, self.gate_proj, self.up_proj)):
            return base(self, x, *args, **kwargs)
        act = self.__dict__["_modules"].get("act_fn")
        if act is not act_fn or _compat.module_hooks_seen(act):
            why = "has forward hooks" if act is act_fn else "was replaced"
            _fallback_once(type(self).__name__, f"act_fn {why} since the patch", "inference_act_fn")
            return base(self, x)
        if _compiling():  # see _projected: no merged weight under torch.compile
            gate_up = _projected(self, GATE_UP, x)
        elif (merged := merged_for_call(self, GATE_UP)) is not None:
            gate_up = F.linear(x, *merged)
        else:
            return base(self, x)
        if activation[0] == "swiglu":
            return self.down_proj(_pk.silu_and_mul(gate_up))
        return self.down_proj(_pk.gelu_and_mul(gate_up, approximate=activation[1]))

    forward._polykernel = "silu_and_mul" if activation[0] == "swiglu" else "gelu_and_mul"  # type: ignore[attr-defined]
    return forward


def shared_kv_sdpa(sdpa: Callable) -> Callable:
    """transformers' SDPA attention function, with a decode step of a grouped-query model run as
    SDPA over each KV head's group of query heads (query head ``h`` reads KV head ``h // groups``,
    as ``repeat_kv`` pairs them): one query row per group member, the same mask row for each, so
    it is the same attention without K and V copied to every query head. Every other call (a
    prompt, no mask, dropout, options SDPA cannot take) goes to ``sdpa`` as it is.

    A boolean mask (transformers' SDPA mask) is made additive once per forward of a patched
    model, not once per layer: SDPA converts a boolean mask on every call (``where(~mask, -big,
    scalar_tensor(0))``: a ``logical_not``, two fills and a ``where`` on the GPU, 4 launches per
    layer), and every layer of one forward gets the same mask tensor (held by that forward's token,
    so only for that forward: outside one, or for another forward, SDPA converts as before). The additive value is the
    dtype's lowest finite number (as transformers' eager masks): a masked key's weight is then
    exp(-huge) = 0 exactly, as with SDPA's own conversion (``-inf``, or ``-65504`` on cuDNN), so the
    attention is the same, bit for bit, in every row that has a key left (a decode row always has
    its own position)."""

    def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        step = None if _compiling() else _FORWARD.get()
        if step is None:
            return mask
        last = step.mask
        if last is not None and last[0] is mask and last[1] == dtype:
            return last[2]
        out = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)
        step.mask = (mask, dtype, out)
        return out

    @functools.wraps(sdpa)
    def attention(
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        is_causal: bool | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        groups = getattr(module, "num_key_value_groups", 1)
        b, hq, s, d = query.shape
        plain = (
            groups == 1
            or s != 1
            or attention_mask is None
            or attention_mask.dim() != 4
            or attention_mask.shape[1] != 1
            or attention_mask.shape[2] != 1
            or dropout
            or key.shape[1] * groups != hq
            or value.shape[-1] != d
            or kwargs.get("softcap") is not None
            or kwargs.get("output_attentions")
            or kwargs.get("position_bias") is not None
        )
        if plain:
            return sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs)
        q = query.reshape(b, key.shape[1], groups, d)  # [B, Hkv, groups, D]: each group's queries as rows
        if attention_mask.dtype == torch.bool:
            attention_mask = additive(attention_mask, query.dtype)
        out = F.scaled_dot_product_attention(q, key, value, attn_mask=attention_mask, scale=scaling)
        return out.reshape(b, hq, 1, d).transpose(1, 2).contiguous(), None

    attention._polykernel = "shared_kv_sdpa"  # type: ignore[attr-defined]
    return attention


class AttentionFunctions:
    """transformers' ``ALL_ATTENTION_FUNCTIONS`` as a patched attention forward sees it: "sdpa"
    answers :func:`shared_kv_sdpa` of transformers' own; everything else is transformers'."""

    def __init__(self, base: Any) -> None:
        self._base = base
        self._wrapped: dict[int, Callable] = {}
        # Wrapped now, not on a forward's first lookup: under torch.compile that lookup filled the
        # dict while Dynamo traced, and the next call failed the trace's guard (a whole recompile).
        sdpa = base.get("sdpa") if hasattr(base, "get") else None
        if sdpa is not None:
            self._wrapped[id(sdpa)] = shared_kv_sdpa(sdpa)

    def get_interface(self, name: str, default: Callable) -> Callable:
        fn = self._base.get_interface(name, default)
        if name != "sdpa":
            return fn
        wrapped = self._wrapped.get(id(fn))
        if wrapped is None:
            wrapped = self._wrapped[id(fn)] = shared_kv_sdpa(fn)
        return wrapped

    def __getitem__(self, name: str) -> Callable:
        return self.get_interface(name, None) if name == "sdpa" else self._base[name]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._base, name)


def decoder_layers(base_model: nn.Module) -> list[nn.Module] | str:
    """The base model's decoder layers if they are Llama's, else why not."""
    layers = getattr(base_model, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers) or not hasattr(base_model, "norm"):
        return "it has no decoder layers (.layers) and final norm (.norm)"
    for layer in layers:
        missing = [a for a in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp") if not hasattr(layer, a)]
        if missing or not all(hasattr(layer.mlp, a) for a in ("gate_proj", "up_proj", "down_proj")):
            return f"{type(layer).__name__} is not Llama's decoder layer (needs input_layernorm, self_attn, post_attention_layernorm, mlp.gate_proj/up_proj/down_proj)"
    return list(layers)
