"""The patched attention forwards: transformers' own, as copies whose globals see polykernel's
rotary functions (``patch``) and, for ``patch(mode="inference")``, the serving attention."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

from . import _fused_attention, _inference
from ._code import _namespace, _with_globals
from ._families import _Family
from ._rope import _rope_function

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
