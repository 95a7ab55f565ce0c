"""What every layer shares: the ``impl=`` check at construction and its repr."""

from __future__ import annotations

from ..core.selection import _parse_names


def _impl_repr(impl: str | None) -> str:
    return f", impl={impl!r}" if impl is not None else ""


def _check_impl(cls: str, impl: str | None) -> str | None:
    """Fail at construction, not at the first call, on a name that is no impl at all."""
    if impl is not None:
        _parse_names(impl, f"{cls}(impl=)")
    return impl
