"""How each private API is probed: once, its fallback taken when forced, when the probe raises or
when it finds nothing, and recorded (:func:`fallbacks`) and logged once. Every other module of
:mod:`polykernel._compat` probes through :func:`_probe`."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from .. import env

log = logging.getLogger("polykernel")

FORCED: bool = env.flag("POLYKERNEL_COMPAT_FALLBACKS", False)
_FORCED_WHY = "forced (POLYKERNEL_COMPAT_FALLBACKS=1)"

_fallbacks: dict[str, str] = {}  # probe name -> why its fallback is in use

T = TypeVar("T")


def _fell_back(name: str, why: str) -> None:
    """Record (and log once) that ``name`` uses its fallback."""
    if name not in _fallbacks:
        _fallbacks[name] = why
        log.info("polykernel: %s: fallback in use (%s)", name, why)


def _probe(name: str, get: Callable[[], T], fallback: T) -> T:
    """``get()``, or ``fallback`` when forced, when it raises or when it returns None."""
    if FORCED:
        _fell_back(name, _FORCED_WHY)
        return fallback
    try:
        value = get()
    except Exception as exc:  # the private API moved or is missing in this build
        _fell_back(name, f"{type(exc).__name__}: {exc}")
        return fallback
    if value is None:
        _fell_back(name, "missing in this build")
        return fallback
    return value


def fallbacks() -> dict[str, str]:
    """The probes that use their fallback so far, with why (lazy probes appear once asked)."""
    return dict(_fallbacks)
