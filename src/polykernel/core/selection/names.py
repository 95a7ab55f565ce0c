"""Impl names as users give them (``"triton"``, ``"triton,torch"``, a ``KernelBackend``, a list),
checked against the ops' impls, with errors that list what exists."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...errors import UnknownImplError, did_you_mean, shown
from ...spec import KernelBackend
from .. import registry


def _split_names(value: Any, where: str) -> tuple[str, ...]:
    """``"triton"``, ``"triton,torch"``, a ``KernelBackend`` or a sequence -> names (unchecked).
    Anything else, or no name at all (``""``, ``",,,"``), is a ``ValueError`` naming ``where``."""
    if isinstance(value, KernelBackend):
        return (value.value,)
    if isinstance(value, str):
        items = [v.strip() for v in value.split(",")]
    elif isinstance(value, (list, tuple)):
        items = [v.value if isinstance(v, KernelBackend) else v.strip() if isinstance(v, str) else v for v in value]
    else:
        raise ValueError(f"{where}: {shown(value)} is not an impl name (expected a name, 'a,b' or a list of names)")
    names = tuple(v for v in items if v != "")
    if not names:
        raise ValueError(f"{where}: {shown(value)} is not an impl name (empty)")
    for name in names:
        if not isinstance(name, str):
            raise ValueError(f"{where}: {shown(name)} is not an impl name (expected a string)")
    return names


def _parse_names(value: str | Sequence[str] | KernelBackend, where: str) -> tuple[str, ...]:
    """Names for a global preference (any op): each must be a ``KernelBackend`` value (one that
    no op has yet is accepted: it skips every op), else a ``ValueError`` that names ``where``
    (the variable or function) and the impl names the registered ops have."""
    names = _split_names(value, where)
    valid = {b.value for b in KernelBackend}
    for name in names:
        if name not in valid:
            raise ValueError(f"{where}: {shown(name)} is not an impl name; {_impl_names_text(name)}")
    return names


def _impl_names_text(name: str) -> str:
    """The impl names some registered op has (the catalog loaded), a close match, and the
    ``KernelBackend`` values reserved for impls no op has yet. Off the hot path: errors only."""
    registry.load_catalog()
    used = sorted({impl for op_id in registry.all_op_ids() for impl in registry.specs_for(op_id)})
    reserved = sorted(b.value for b in KernelBackend if b.value not in used)
    text = f"the ops' impls are: {', '.join(used)}{did_you_mean(name, used + reserved, longest=64)}"
    if reserved:
        text += f"; KernelBackend also reserves {', '.join(reserved)}, which no op has yet"
    return text


def _parse_op_names(value: Any, where: str, op_id: str, runnable: Sequence[str] | None = None) -> tuple[str, ...]:
    """Names asked of one op (``impl=``, ``op=``, ``POLYKERNEL_IMPL_<OP>``): a name that is not
    a ``KernelBackend`` value, or a single name the op lacks, is an :class:`UnknownImplError`
    listing the op's impls. (A list may name impls the op lacks: it is a preference.)"""
    valid = sorted(registry.specs_for(op_id))
    try:
        names = _split_names(value, where)
    except ValueError:
        raise UnknownImplError(op_id, value, valid, where, runnable) from None
    backends = {b.value for b in KernelBackend}
    for name in names:
        if name not in backends or (len(names) == 1 and name not in valid):
            raise UnknownImplError(op_id, name, valid, where, runnable)
    return names
