"""Impl specs by op, and lazy discovery of the modules that register them.

The built-in ops and their impl tables are listed in :mod:`polykernel.ops` and load on first use
of an op. Other modules (peer adapters, a user's own kernels) are named with
:func:`declare_op_locations` and are imported only when their op is first used. A module that
fails to import is recorded with its error (``explain`` shows it); it never raises here.
"""

from __future__ import annotations

import importlib
import threading
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, overload

from ..errors import UnknownOpError
from ..spec import KernelBackend, KernelSpec

if TYPE_CHECKING:
    from .op import Op

__all__ = ["all_op_ids", "declare_op_locations", "get_op", "register_impl", "resolve_op_id", "specs_for"]

_lock = threading.RLock()
_specs: dict[str, dict[str, KernelSpec]] = {}
_ops: dict[str, Op] = {}
_locations: dict[str, list[str]] = {}
_imported: set[str] = set()
_importing: set[str] = set()
_import_errors: dict[str, dict[str, str]] = {}
# Told when the set of impls changes, with the op id it changed for (None: any op may have).
# This is how the layers above (the dispatcher's memo, the custom-op builder) hear of changes
# without this module importing them.
_listeners: list[Callable[[str | None], None]] = []


# The built-in op catalog: a module above this layer, found by name as plugins are (it also
# wires the core's hooks to the compile and distributed layers: polykernel.core.hooks).
CATALOG_MODULE = "polykernel.ops"


def load_catalog() -> dict[str, str]:
    """The built-in ops' ids -> their modules (imports the catalog package once)."""
    return importlib.import_module(CATALOG_MODULE).OP_MODULES


_catalog = load_catalog


def all_op_ids() -> list[str]:
    """Every known op id, built-in and user-defined, sorted."""
    return sorted(set(_catalog()) | set(_ops))


def resolve_op_id(op: str | Op) -> str:
    """``"rms_norm"`` or ``"norm.rms_norm"`` -> ``"norm.rms_norm"``; unknown -> UnknownOpError."""
    if not isinstance(op, str):
        return op.id
    known = all_op_ids()
    if op in known:
        return op
    matches = [k for k in known if k.rpartition(".")[2] == op]
    if len(matches) == 1:
        return matches[0]
    raise UnknownOpError(op, [k.rpartition(".")[2] for k in known])


def get_op(op: str | Op) -> Op:
    """The :class:`~polykernel.core.op.Op` object for an id or bare name (imports its module once)."""
    op_id = resolve_op_id(op)
    hit = _ops.get(op_id)
    if hit is None:
        importlib.import_module(_catalog()[op_id])
        hit = _ops[op_id]
    return hit


def _add_op(op: Op) -> None:
    with _lock:
        _ops[op.id] = op
        _specs.setdefault(op.id, {})
    _changed(op.id)


def _changed(op_id: str | None = None) -> None:
    """Tell the listeners that ``op_id``'s impls (None: possibly every op's) have changed."""
    for fn in _listeners:
        fn(op_id)


@overload
def register_impl(spec: KernelSpec) -> KernelSpec: ...
@overload
def register_impl(spec: None = None, **fields: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]: ...


def register_impl(spec: KernelSpec | None = None, **fields: Any) -> Any:
    """Register an impl. Use with a :class:`KernelSpec`, or as a decorator factory::

        @polykernel.register_impl(op="rms_norm", backend="cuda_jit", rank=5)
        def my_rms_norm(x, weight, eps, offset, casting): ...

    The decorated function becomes the target; ``op`` may be a bare name. Registering a second
    impl with the same backend name for an op replaces the first.
    """
    if spec is not None:
        _store(spec)
        return spec

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        target = f"{fn.__module__}:{fn.__qualname__}"
        made = KernelSpec(target=target, **{**fields, "op": resolve_op_id(fields["op"])})
        _store(made, loaded=fn)
        return fn

    if "op" not in fields or "backend" not in fields:
        raise TypeError("register_impl(...) as a decorator needs op= and backend=")
    KernelBackend(fields["backend"])  # fail at registration, not at first call
    return decorate


_preloaded: dict[tuple[str, str], Callable[..., Any]] = {}


def _store(spec: KernelSpec, loaded: Callable[..., Any] | None = None) -> None:
    op_id = resolve_op_id(spec.op)
    if op_id != spec.op:
        import dataclasses

        spec = dataclasses.replace(spec, op=op_id)
    with _lock:
        _specs.setdefault(op_id, {})[spec.impl] = spec
        if loaded is not None:
            _preloaded[(op_id, spec.impl)] = loaded
        else:
            _preloaded.pop((op_id, spec.impl), None)
    _changed(op_id)


def load_impl(spec: KernelSpec) -> Callable[..., Any]:
    """The spec's callable: the decorated function itself, or ``spec.load()``."""
    fn = _preloaded.get((spec.op, spec.impl))
    return fn if fn is not None else spec.load()


def declare_op_locations(op: str, *modules: str) -> None:
    """Name modules that register impls of ``op``; they are imported on the op's first use."""
    op_id = resolve_op_id(op)
    with _lock:
        known = _locations.setdefault(op_id, [])
        for m in modules:
            if m not in known:
                known.append(m)
    _changed(op_id)


def specs_for(op: str | Op) -> dict[str, KernelSpec]:
    """Impl name -> spec for an op, after importing every declared location (once each)."""
    the_op = get_op(op)
    pending = [m for m in _locations.get(the_op.id, ()) if m not in _imported]
    if pending:
        # A module counts as imported only once its import has finished (under the lock), so a
        # thread that finds nothing pending never sees an op without that module's impls.
        with _lock:
            for module in pending:
                if module in _imported or module in _importing:  # done, or our own import is re-entering
                    continue
                _importing.add(module)
                try:
                    importlib.import_module(module)
                except Exception as exc:  # recorded and shown by explain, never raised here
                    last = traceback.format_exception_only(type(exc), exc)[-1].strip()
                    _import_errors.setdefault(the_op.id, {})[module] = last
                finally:
                    _importing.discard(module)
                    _imported.add(module)
    return dict(_specs.get(the_op.id, {}))


def import_errors(op: str | Op) -> dict[str, str]:
    """Declared modules of ``op`` that failed to import, with their error line."""
    return dict(_import_errors.get(resolve_op_id(op), {}))
