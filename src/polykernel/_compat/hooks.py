"""Whether an ``nn.Module`` has forward (pre-)hooks of its own, read from its private hook dicts:
polykernel's patches and fused paths bypass a module's forward only where none are set."""

from __future__ import annotations

import torch

from .probe import _probe

_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks")
_hooks_readable: bool = _probe(
    "module_has_hooks", lambda: all(isinstance(getattr(torch.nn.Module(), n), dict) for n in _HOOK_DICTS) or None, False
)


def module_has_hooks(m: torch.nn.Module) -> bool:
    """Whether forward (pre-)hooks are set on ``m`` itself. Fallback: True (cannot tell: callers
    that would bypass ``m``'s forward leave it alone)."""
    return not _hooks_readable or any(getattr(m, n, None) for n in _HOOK_DICTS)


def module_hooks_seen(m: torch.nn.Module) -> bool:
    """:func:`module_has_hooks` with the other fallback, False: callers whose fused path ran past
    ``m`` before they looked keep it."""
    return _hooks_readable and any(getattr(m, n, None) for n in _HOOK_DICTS)
