"""Measured selection (step 5 of the resolution order): the hook and its in-process store.

What is here: ``POLYKERNEL_TUNE=off|cached|on`` is read, and a decision recorded with
:func:`remember` is honoured by the dispatcher for its key while the mode is not ``off``.
What is not here yet (a later issue, see DESIGN.md "Measured selection"): measuring impls on
first sight of a key, the JSON store under ``$POLYKERNEL_CACHE_DIR`` with its file lock, the
environment identity in the key, and broadcasting rank 0's decision under torch.distributed.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .op import Op

_MODES = ("off", "cached", "on")
_store: dict[tuple[str, tuple[Any, ...]], str] = {}


def mode() -> str:
    value = os.environ.get("POLYKERNEL_TUNE", "cached").strip().lower() or "cached"
    if value not in _MODES:
        raise ValueError(f"POLYKERNEL_TUNE={value!r}: expected one of {', '.join(_MODES)}")
    return value


def lookup(op: Op, argkey: tuple[Any, ...]) -> str | None:
    """The stored impl name for this op and argument class, or None."""
    if not _store or mode() == "off":
        return None
    return _store.get((op.id, argkey))


def remember(op: Op, argkey: tuple[Any, ...], impl: str) -> None:
    """Record a measured decision for ``(op, argkey)``; memoized decisions are dropped."""
    from . import registry

    _store[(op.id, argkey)] = impl
    registry._changed()


def clear_cache() -> None:
    """Forget every in-process decision (``polykernel.clear_caches`` calls this)."""
    _store.clear()
