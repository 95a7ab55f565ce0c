"""What every layer shares: the ``impl=`` check at construction and its repr, and the size and
``eps`` checks of the normalisation layers."""

from __future__ import annotations

import operator
from typing import Any

from ..core.selection import _parse_names
from ..ops import _checks


def _impl_repr(impl: str | None) -> str:
    return f", impl={impl!r}" if impl is not None else ""


def _check_impl(cls: str, impl: str | None) -> str | None:
    """Fail at construction, not at the first call, on a name that is no impl at all."""
    if impl is not None:
        _parse_names(impl, f"{cls}(impl=)")
    return impl


def _size(cls: str, name: str, value: Any) -> int:
    """A dimension size: a positive int (not a bool; ``int(16.7)`` would truncate silently), or for
    the last-dim layers a one-element ``normalized_shape`` as torch's ``RMSNorm``/``LayerNorm``
    take it (``(d,)``, ``[d]``, ``torch.Size([d])``)."""
    if isinstance(value, (tuple, list)):  # torch.Size is a tuple
        if len(value) != 1:
            raise _checks.OpArgumentError(
                cls, name, f"normalizes over the last dim only: expected an int or a one-element shape, got {tuple(value)}"
            )
        (value,) = value
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise _checks.OpTypeError(cls, name, f"expected an int, got {value!r}")
    value = operator.index(value)
    if value <= 0:
        raise _checks.OpArgumentError(cls, name, f"expected a positive int, got {value}")
    return value


def _eps(cls: str, eps: Any) -> Any:
    """The ops' own ``eps`` check, at construction (not at the first call)."""
    _checks.eps(cls, eps)
    return eps
