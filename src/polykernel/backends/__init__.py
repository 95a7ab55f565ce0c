"""The backends: one package per provenance, each registering its impls onto the ops it serves.

A backend's package ``polykernel/backends/<name>/`` says which ops it implements in its
**manifest**, ``manifest.py``: a torch-free module whose ``IMPLS`` maps an op id to the backend's
impl row for that op (:meth:`polykernel.backends.declare.Backend.impl`: rank or ``rank_for`` rule,
predicate, description, target). Op files know no backend: an op's impl table is the union of
what the manifests declare for it, built by :func:`declared` when the op is first used (its
:class:`~polykernel.core.op.Op` registers). The manifests are small and torch-free, so all of them
are read then, once; a backend's kernel modules are imported only when one of its impls is
selected (``KernelSpec.load``).

Adding a backend is a new package with a ``manifest.py``: nothing else lists it.

The backend packages are independent: none imports another (an import-linter contract in
pyproject.toml). Code several backends share lives beside them (``backends/_*.py``), and a case a
kernel does not take goes to another impl by its registered name, usually the torch impl
(:func:`polykernel.backends._fallback.registered`).
"""

from __future__ import annotations

import importlib
import pkgutil
import threading
from types import ModuleType

from ..spec import KernelSpec

__all__ = ["declared", "declaring", "manifests"]

_lock = threading.Lock()
_loaded: tuple[ModuleType, ...] | None = None


def manifests() -> tuple[ModuleType, ...]:
    """Every backend package's manifest module, imported once (in package-name order)."""
    global _loaded
    if _loaded is None:
        with _lock:
            if _loaded is None:
                names = sorted(m.name for m in pkgutil.iter_modules(__path__) if m.ispkg)
                found = []
                for name in names:
                    try:
                        found.append(importlib.import_module(f"{__name__}.{name}.manifest"))
                    except ModuleNotFoundError as exc:  # a backend package without impls of its own
                        if exc.name != f"{__name__}.{name}.manifest":
                            raise
                _loaded = tuple(found)
    return _loaded


def declaring(op_id: str, impl: str) -> list[str]:
    """The manifests (module names) that declare ``impl`` for ``op_id`` (for the clash errors)."""
    return [m.__name__ for m in manifests() if op_id in m.IMPLS and m.IMPLS[op_id].spec(op_id).impl == impl]


def declared(op_id: str) -> list[KernelSpec]:
    """The impls the backends' manifests declare for ``op_id``, as specs (ordered by rank, name)."""
    specs = [m.IMPLS[op_id].spec(op_id) for m in manifests() if op_id in m.IMPLS]
    names = [s.impl for s in specs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:  # an impl's name is its backend: two manifests may not both declare one
        where = "; ".join(f"impl {n} declared by more than one backend manifest ({', '.join(declaring(op_id, n))})" for n in twice)
        raise ValueError(f"{op_id}: {where}: an impl's name is its backend, declare it once")
    return sorted(specs, key=lambda s: (s.rank, s.impl))
