"""The patched attention forwards: transformers' own, as copies whose globals see polykernel's
rotary functions and, for a family with sinks, its eager attention on the fused kernels
(``patch``); for ``patch(mode="inference")``, the serving attention."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

from . import _fused_attention, _inference, _sinks
from ._code import _namespace, _with_globals
from ._families import _Family
from ._rope import _rope_function

_SINKS = "eager_attention_forward"  # the function a family with sinks runs its attention through
_ATTENTION_NAMESPACES: dict[tuple[str, bool, bool], dict] = {}


def _attention_forward(base: Callable, modeling: types.ModuleType, family: _Family, rope: bool = True, sinks: bool = False) -> Callable:
    """``base`` seeing polykernel's rotary functions (``rope``) and, for a family with sinks,
    :func:`_sinks.eager_with_sinks` as its eager attention (``sinks``). Its kind: ``rope``, else
    ``attention_sinks``; with both, ``attention_sinks`` is its second kind (``_polykernel_also``)."""
    calls = tuple(name for name, _ in family.rope) if rope else ()
    key = (modeling.__name__, rope, sinks)
    ns = _ATTENTION_NAMESPACES.get(key)
    if ns is None:
        swapped: dict[str, Any] = {}
        if rope:
            swapped.update(
                {name: _rope_function(getattr(modeling, name), layout) for name, layout in family.rope if hasattr(modeling, name)}
            )
        if sinks:
            eager = getattr(modeling, _SINKS)
            swapped[_SINKS] = _sinks.eager_with_sinks(getattr(eager, "_polykernel_eager", eager))  # (patched by type: its original)
        ns = _ATTENTION_NAMESPACES[key] = _namespace(modeling.__dict__, **swapped)
    forward = _with_globals(base, modeling.__dict__, ns, calls + ((_SINKS,) if sinks else ()))
    forward._polykernel = "rope" if rope else "attention_sinks"  # type: ignore[attr-defined]
    forward._polykernel_also = ("attention_sinks",) if rope and sinks else ()  # type: ignore[attr-defined]
    return forward


_INFERENCE_NAMESPACES: dict[tuple[str, bool], dict] = {}


def _inference_attention(base: Callable, modeling: types.ModuleType, family: _Family, rope: bool, fuse: bool = False) -> Callable:
    """``patch(mode="inference")``'s attention forward: transformers' own, seeing
    :class:`_inference.AttentionFunctions` (decode with shared KV heads) and, with ``rope``, the
    rotary functions on ``polykernel.rope``; with ``fuse`` (``rope`` too, q/k/v merged), that
    forward behind :func:`_fused_attention.fused_attention_forward` (merged QKV, RoPE fused with the
    static KV cache's write), which runs it for every call it does not fuse."""
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
        forward = _fused_attention.fused_attention_forward(
            forward, ns["ALL_ATTENTION_FUNCTIONS"], getattr(modeling, "eager_attention_forward", None)
        )
    return forward
