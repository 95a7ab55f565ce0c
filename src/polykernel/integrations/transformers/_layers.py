"""RMSNorm and gated MLP forwards on polykernel.rms_norm, swiglu and geglu."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import polykernel as _pk
from polykernel import _compat

from ._families import _Norm
from ._switches import _has_op


# -- RMSNorm -----------------------------------------------------------------------------------
def _fallback_once(cls: str, why: str, kind: str = "rms_norm") -> None:
    """A patched module runs transformers' forward: logged once per class and kind (an error under
    POLYKERNEL_STRICT=1)."""
    from polykernel.core.selection.state import fallback_once

    message = f"polykernel: patch(): {cls} {why}; running transformers' forward for it (POLYKERNEL_STRICT=1 makes this an error)"
    fallback_once(("transformers", kind, cls), message)


def _hooked_activation(owner: nn.Module, act: Any, kind: str) -> bool:
    """Forward hooks on ``owner``'s activation module (activation capture, steering, ablation) would
    not run inside the fused op: True, logged once, when it has them (where hooks cannot be read, the
    fused op runs, as it did before this check)."""
    if not (isinstance(act, nn.Module) and _compat.module_hooks_seen(act)):
        return False
    _fallback_once(type(owner).__name__, "has forward hooks on its activation", kind)
    return True


def _rms_norm_forward(base: Callable, norm: _Norm) -> Callable:
    offset, casting = norm.offset, norm.casting

    @functools.wraps(base)
    def forward(self: nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        weight = self.weight
        # Llama's `weight * x̂.to(dtype)` promotes: an fp32 weight on bf16 x gives an fp32 result,
        # which polykernel (output dtype = x.dtype) does not; the original handles that case.
        if args or kwargs or (casting == "llama" and torch.promote_types(weight.dtype, hidden_states.dtype) != hidden_states.dtype):
            return base(self, hidden_states, *args, **kwargs)
        eps = norm.eps_of(self)
        if eps is None:  # a transformers that renamed the attribute again: its own forward, logged once
            _fallback_once(type(self).__name__, "has neither `variance_epsilon` nor `eps`")
            return base(self, hidden_states, *args, **kwargs)
        return _pk.rms_norm(hidden_states, weight, eps, offset=offset, casting=casting)

    forward._polykernel = "rms_norm"  # type: ignore[attr-defined]
    return forward


# -- gated MLP ---------------------------------------------------------------------------------
def _gated_activation(act: Any) -> tuple[str, str | None] | None:
    """``("swiglu", None)`` / ``("geglu", approximate)`` for the activations polykernel fuses, else None."""
    cls = type(act)
    name = cls.__name__
    from_hf = cls.__module__ == "transformers.activations"
    # (a subclass with a forward of its own computes something else: not ours to fuse)
    if (isinstance(act, nn.SiLU) and cls.forward is nn.SiLU.forward) or (from_hf and name == "SiLUActivation"):
        return ("swiglu", None)
    if from_hf and name in ("GELUTanh", "PytorchGELUTanh"):
        return ("geglu", "tanh")
    if from_hf and name == "GELUActivation":  # nn.functional.gelu or the erf formula: exact GELU
        return ("geglu", "none")
    if isinstance(act, nn.GELU) and cls.forward is nn.GELU.forward and act.approximate in ("none", "tanh"):
        return ("geglu", act.approximate)
    return None


def _mlp_layout(module: nn.Module) -> tuple[str, Any] | None:
    """``("split" | "merged", activation)``: ``gate_proj``/``up_proj`` or Phi3-style ``gate_up_proj``
    (gate first, then up, chunked in two), with ``down_proj``; None for any other MLP."""
    act = getattr(module, "act_fn", None)
    if act is None:
        act = getattr(module, "activation_fn", None)
    if act is None or not hasattr(module, "down_proj"):
        return None
    if hasattr(module, "gate_proj") and hasattr(module, "up_proj"):
        return "split", act
    if hasattr(module, "gate_up_proj"):
        return "merged", act
    return None


def _mlp_forward(base: Callable, ops: frozenset[str]) -> Callable:
    """``ops``: the gated activations available in this build (``swiglu``, ``geglu``)."""

    @functools.wraps(base)
    def forward(self: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        layout = _mlp_layout(self)
        kind = _gated_activation(layout[1]) if layout is not None else None
        if args or kwargs or kind is None or kind[0] not in ops or _hooked_activation(self, layout[1], _GATED_MLP):
            return base(self, x, *args, **kwargs)
        if layout[0] == "split":
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:  # views of the merged projection's two halves, as Phi3MLP.forward takes them
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        if kind[0] == "swiglu":
            return self.down_proj(_pk.swiglu(gate, up))
        return self.down_proj(_pk.geglu(gate, up, approximate=kind[1]))

    forward._polykernel = _GATED_MLP  # type: ignore[attr-defined]
    return forward


_GATED_MLP = "swiglu"  # the gated MLP forward's tag: patched() reports swiglu or geglu per module


def _mlp_supported(module: nn.Module) -> str | None:
    """Why this MLP cannot be patched, or None."""
    layout = _mlp_layout(module)
    if layout is None:
        return "it has no gate_proj/up_proj (or gate_up_proj), down_proj and act_fn"
    kind = _gated_activation(layout[1])
    if kind is None:
        return f"its activation {type(layout[1]).__name__} is not SiLU or GELU"
    if not _has_op(kind[0]):
        return f"polykernel.{kind[0]} is not available in this build"
    return None
