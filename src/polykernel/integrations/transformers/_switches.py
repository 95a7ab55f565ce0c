"""``patch``'s switches: the polykernel ops each one needs (ops land independently; a switch
whose ops are all missing from this build is skipped with a warning)."""

from __future__ import annotations

import functools
import logging

import polykernel as _pk

from ._families import _LEFT_ALONE_SWITCH

logger = logging.getLogger(__package__)

# switch -> the polykernel public ops it needs (the MLP switch covers both gated activations)
_SWITCH_OPS = {
    "rms_norm": ("rms_norm",),
    "swiglu": ("swiglu", "geglu"),
    "rope": ("rope",),
    "cross_entropy": ("cross_entropy",),
    "fused_linear_cross_entropy": ("fused_linear_cross_entropy",),
    "sdpa_is_causal": (),  # no polykernel op: how transformers hands the causal mask to SDPA
    "attention_sinks": (),  # no polykernel op: gpt_oss's attention on torch's fused kernels (_sinks.py)
    "moe_experts": ("moe_experts", "moe_experts_gpt_oss"),  # transformers' Experts layout, gpt-oss's
}


@functools.cache
def _has_op(name: str) -> bool:
    try:
        getattr(_pk, name)
    except (ImportError, AttributeError):
        return False
    return True


def _missing_ops(switch: str) -> tuple[str, ...]:
    return tuple(name for name in _SWITCH_OPS[switch] if not _has_op(name))


def _gated_ops() -> frozenset[str]:
    return frozenset(n for n in _SWITCH_OPS["swiglu"] if _has_op(n))


def _enabled(switches: dict[str, bool]) -> dict[str, bool]:
    out = {}
    for name, on in switches.items():
        missing = _missing_ops(name) if on else ()
        if on and missing and len(missing) == len(_SWITCH_OPS[name]):
            logger.warning("polykernel: %s is not available in this build; %s= is skipped", ", ".join(missing), name)
            on = False
        out[name] = bool(on)
    return out


def _requested(left: dict[str, str], on: dict[str, bool]) -> dict[str, str]:
    """The reasons for the kinds whose switch is on (a switch turned off leaves nothing to explain)."""
    return {kind: why for kind, why in left.items() if on.get(_LEFT_ALONE_SWITCH.get(kind, ""), True)}
