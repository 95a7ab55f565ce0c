"""The merged projections of ``patch(model, mode="inference")``: a module's gate/up or q/k/v
linear layers run as one matmul, on their weights (and biases) concatenated once along the output
dim, which the layers' parameters then view (no memory is added). Each call checks that the layers
are still plain, unhooked and viewing the merged weight, merging again or running the module's own
forward where not; a conversion (``.to()``) drops merged weights the layers no longer view."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from polykernel import _compat

from ._layers import _fallback_once

# Projections that one matmul runs, as (key, the module's projection attributes): their weights
# (and biases) concatenated along the output dim, in this order.
GATE_UP = ("gate_up", ("gate_proj", "up_proj"))
QKV = ("qkv", ("q_proj", "k_proj", "v_proj"))
MERGED = tuple(f"_polykernel_{key}_{name}" for key, _ in (GATE_UP, QKV) for name in ("weight", "bias"))  # module.__dict__ entries
_APPLY = "_apply"  # and, where merged, the module's own nn.Module._apply (see _apply_unmerged)


def wants_grad(x: torch.Tensor, *projections: nn.Module) -> bool:
    """Whether autograd wants this call's gradients (of ``x`` or of any of the projections'
    parameters, biases too): the merged matmul's weight is detached, so their own forwards run
    then. (Callers test ``torch.is_grad_enabled()`` first: a decode step pays nothing more.)"""
    return x.requires_grad or any(p.requires_grad for m in projections for p in m.parameters())


def _views_of(merged: torch.Tensor, parts: list[torch.Tensor]) -> bool:
    """Whether ``parts`` are still the consecutive row blocks of ``merged`` (not moved since)."""
    at, row = merged.data_ptr(), merged.stride(0) * merged.element_size()
    for part in parts:
        if part.data_ptr() != at:
            return False
        at += part.shape[0] * row
    return True


def _merged(module: nn.Module, group: tuple[str, tuple[str, ...]], name: str) -> torch.Tensor | None:
    """The ``group``'s projections' ``name`` ("weight" or "bias") as one tensor, concatenated along
    dim 0, whose row blocks the projections' parameters view (so no memory is added); merged again
    after the parameters moved (``.to()``). None where the projections have no ``name``."""
    key, attrs = group
    parts = [getattr(getattr(module, a), name) for a in attrs]
    if parts[0] is None:
        return None
    merged = module.__dict__.get(f"_polykernel_{key}_{name}")
    if merged is not None and _views_of(merged, parts):
        return merged
    with torch.inference_mode(False), torch.no_grad():  # parameters stay normal tensors, even if first merged under inference_mode
        merged = torch.cat([p.detach() for p in parts], 0)
        start = 0
        for p in parts:
            p.data, start = merged[start : start + p.shape[0]], start + p.shape[0]
    d = module.__dict__
    d[f"_polykernel_{key}_{name}"] = merged
    if _APPLY not in d:
        d[_APPLY] = types.MethodType(_apply_unmerged, module)
    return merged


def _apply_unmerged(module: nn.Module, fn: Callable, *args: Any, **kwargs: Any) -> nn.Module:
    """``nn.Module._apply`` (``.to()``, ``.half()`` ...), then the merged weights the projections no
    longer view dropped (after ``model.to("cpu")`` they would hold the GPU's gate/up and QKV weights
    until a next forward merged again, which may never come); a no-op conversion keeps them."""
    out = type(module)._apply(module, fn, *args, **kwargs)
    d = module.__dict__
    for key, attrs in (GATE_UP, QKV):
        for name in ("weight", "bias"):
            merged = d.get(f"_polykernel_{key}_{name}")
            parts = [getattr(d["_modules"].get(a), name, None) for a in attrs]
            if merged is not None and (any(p is None for p in parts) or not _views_of(merged, parts)):
                del d[f"_polykernel_{key}_{name}"]
    return out


def unmerged(d: dict[str, Any]) -> list[tuple[str, tuple[str, ...]]]:
    """Remove from ``d`` (a module's ``__dict__`` or a copy of it) what merging added; returns the
    groups that were merged."""
    groups = [group for group in (GATE_UP, QKV) if d.get(f"_polykernel_{group[0]}_weight") is not None]
    for key in MERGED:
        d.pop(key, None)
    if getattr(d.get(_APPLY), "__func__", None) is _apply_unmerged:
        del d[_APPLY]
    return groups


def mergeable(module: nn.Module, group: tuple[str, tuple[str, ...]]) -> str | None:
    """Why the ``group``'s projections cannot run as one matmul, or None: linear layers of one
    input size, dtype and device, all with a bias or none."""
    projections = [getattr(module, a, None) for a in group[1]]
    if not all(isinstance(p, nn.Linear) and type(p).forward is nn.Linear.forward for p in projections):
        return f"{', '.join(group[1])} are not all plain nn.Linear"
    weights = [p.weight for p in projections]
    if len({(w.shape[1], w.dtype, w.device) for w in weights}) != 1:
        return f"{', '.join(group[1])} differ in input size, dtype or device"
    if len({p.bias is None for p in projections}) != 1:
        return f"{', '.join(group[1])} do not all have a bias (or all none)"
    return None


def _merged_and_plain(module: nn.Module, group: tuple[str, tuple[str, ...]]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The per-call check's common answer, from the modules' own dicts (nn.Module's attribute
    lookups cost more than the rest): the merged weight and bias when the projections are plain
    unhooked nn.Linear layers that still view them (so of one dtype, device and width), all with
    a bias or none; else None (:func:`merged_for_call` says why, :func:`_merged` merges again)."""
    d = module.__dict__
    merged, children = d.get(f"_polykernel_{group[0]}_weight"), d.get("_modules")
    if merged is None or children is None:
        return None
    weights, biases = [], []
    for name in group[1]:
        p = children.get(name)
        if type(p) is not nn.Linear or _compat.module_hooks_seen(p):
            return None
        params = p.__dict__["_parameters"]
        weights.append(params.get("weight"))
        biases.append(params.get("bias"))
    if any(w is None for w in weights) or not _views_of(merged, weights):
        return None
    if all(b is None for b in biases):
        return merged, None
    bias = d.get(f"_polykernel_{group[0]}_bias")
    if bias is None or any(b is None for b in biases) or not _views_of(bias, biases):
        return None
    return merged, bias


def merged_for_call(module: nn.Module, group: tuple[str, tuple[str, ...]]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The merged weight and bias this call may run the ``group``'s projections on as one matmul
    (merged again if the projections were reassigned but are still mergeable), else None: wrapped
    after the patch (PEFT's LoRA, a quantized layer) or hooked, the merged matmul would skip what
    their forwards add, so the module's own forward runs (logged once; an error under
    POLYKERNEL_STRICT=1)."""
    merged = _merged_and_plain(module, group)
    if merged is not None:  # the common call: one check
        return merged
    why = mergeable(module, group)
    if why is None and any(_compat.module_hooks_seen(getattr(module, a)) for a in group[1]):
        why = f"{', '.join(group[1])} have forward hooks"
    if why is None:
        return _merged(module, group, "weight"), _merged(module, group, "bias")
    _fallback_once(type(module).__name__, f"cannot run as one matmul now ({why})", f"inference_{group[0]}")
    return None


def _projected(module: nn.Module, group: tuple[str, tuple[str, ...]], x: torch.Tensor) -> torch.Tensor:
    """The ``group``'s projections of ``x`` in the merged layout, each run as its own module (its
    forward, hooks, a wrapper such as PEFT's LoRA): what a call under torch.compile runs. Whether the
    projections still view the merged weight is a data-pointer test that Dynamo cannot trace, and
    no guard of its covers every way they stop doing so (``load_state_dict(assign=True)`` of
    same-shaped weights, ``p.data = ...``): a merged matmul there could read a stale weight. The
    GEMMs are the projections' own; what is concatenated is their outputs, not the weights."""
    return torch.cat([getattr(module, name)(x) for name in group[1]], -1)


def merge(module: nn.Module, group: tuple[str, tuple[str, ...]]) -> None:
    """Merge the ``group``'s projections now (at patch time, outside any inference mode)."""
    _merged(module, group, "weight")
    _merged(module, group, "bias")
