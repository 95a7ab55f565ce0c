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
    """A dimension size as :func:`_count` takes it, or for the last-dim layers a one-element
    ``normalized_shape`` as torch's ``RMSNorm``/``LayerNorm`` take it (``(d,)``, ``[d]``,
    ``torch.Size([d])``)."""
    if isinstance(value, (tuple, list)):  # torch.Size is a tuple
        if len(value) != 1:
            raise _checks.OpArgumentError(
                cls, name, f"normalizes over the last dim only: expected an int or a one-element shape, got {tuple(value)}"
            )
        (value,) = value
    return _count(cls, name, value)


def _count(cls: str, name: str, value: Any) -> int:
    """A positive int (not a bool; ``int(16.7)`` would truncate silently, ``int(True)`` be 1)."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise _checks.OpTypeError(cls, name, f"expected an int, got {value!r}")
    value = operator.index(value)
    if value <= 0:
        raise _checks.OpArgumentError(cls, name, f"expected a positive int, got {value}")
    return value


def _dim(cls: str, value: Any) -> int:
    """A dim index, any sign (the op checks its range against x): ``int(1.7)`` would be dim 1."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise _checks.OpTypeError(cls, "dim", f"expected an int, got {value!r}")
    return operator.index(value)


def _number(cls: str, name: str, value: Any, *, positive: bool = False) -> float:
    """A finite real number (not a bool: a positional flag of another module's signature)."""
    if positive:
        _checks.positive_float(cls, name, value)
    _checks.finite_float(cls, name, value)
    return float(value)


def _eps(cls: str, eps: Any) -> Any:
    """The ops' own ``eps`` check, at construction (not at the first call)."""
    _checks.eps(cls, eps)
    return eps
