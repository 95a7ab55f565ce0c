"""Impl specs by op, and lazy discovery of the modules that register them.

The built-in ops and their impl tables are listed in :mod:`polykernel.ops` and load on first use
of an op. Other modules (peer adapters, a user's own kernels) are named with
:func:`declare_op_locations` and are imported only when their op is first used. A module that
fails to import is recorded with its error (``explain`` shows it); it never raises here.

All of it is one :class:`Registry` object, :data:`REGISTRY`; the module's functions are its
methods. ``snapshot()``/``restore()`` save and put back its whole state (tests, a scoped
experiment: :func:`polykernel.testing.isolated`)::

    >>> from polykernel.core.registry import REGISTRY
    >>> saved = REGISTRY.snapshot()
    >>> REGISTRY.restore(saved)
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, overload

from ..errors import UnknownOpError
from ..spec import KernelBackend, KernelSpec

if TYPE_CHECKING:
    from .protocols import OpLike

__all__ = [
    "REGISTRY",
    "Registry",
    "Snapshot",
    "all_op_ids",
    "declare_op_locations",
    "get_op",
    "load_catalog",
    "register_impl",
    "resolve_op_id",
    "specs_for",
]

# The built-in op catalog: a module above this layer, found by name as plugins are (it also
# wires the core's hooks to the compile and distributed layers: polykernel.core.hooks).
CATALOG_MODULE = "polykernel.ops"
# The backends, which register their impls onto ops through their manifests
# (polykernel.backends.declared): above this layer too, found by name.
BACKENDS_MODULE = "polykernel.backends"


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """A registry's state at one moment (copies: later registrations do not change it)."""

    specs: dict[str, dict[str, KernelSpec]]
    preloaded: dict[tuple[str, str], Callable[..., Any]]
    locations: dict[str, list[str]]
    imported: frozenset[str]
    import_errors: dict[str, dict[str, str]]


class Registry:
    """Ops, their impl specs, declared impl locations and what importing them gave."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._specs: dict[str, dict[str, KernelSpec]] = {}
        self._ops: dict[str, OpLike] = {}
        self._locations: dict[str, list[str]] = {}
        self._imported: set[str] = set()
        self._importing = threading.local()  # .modules: the locations this thread is importing
        self._import_errors: dict[str, dict[str, str]] = {}
        self._preloaded: dict[tuple[str, str], Callable[..., Any]] = {}
        # The impls each op declares (its built-ins), kept apart so that restore() can put them
        # back for an op first loaded after the snapshot even when a registration in between
        # replaced one of them by name.
        self._builtin: dict[str, dict[str, KernelSpec]] = {}
        # Told when the set of impls changes, with the op id it changed for (None: any op may
        # have). This is how the layers above (the dispatcher's memo, the custom-op builder)
        # hear of changes without this module importing them.
        self._listeners: list[Callable[[str | None], None]] = []

    # -- ops ----------------------------------------------------------------------------------
    def load_catalog(self) -> dict[str, str]:
        """The built-in ops' ids -> their modules (imports the catalog package once)."""
        return importlib.import_module(CATALOG_MODULE).OP_MODULES

    def all_op_ids(self) -> list[str]:
        """Every known op id, built-in and user-defined, sorted."""
        return sorted(set(self.load_catalog()) | set(self._ops))

    def resolve_op_id(self, op: str | OpLike | Callable[..., Any]) -> str:
        """``"rms_norm"``, ``"norm.rms_norm"``, the ``Op`` or the public function
        ``polykernel.rms_norm`` -> ``"norm.rms_norm"``; unknown -> UnknownOpError."""
        if not isinstance(op, str):
            op_id = getattr(op, "id", None)
            if isinstance(op_id, str):
                return op_id
            # a public op function: its module (ops/<op>.py) names the op it calls
            module = sys.modules.get(getattr(op, "__module__", None) or "")
            op_id = getattr(module, "OP_ID", None)
            if isinstance(op_id, str) and getattr(module, getattr(op, "__name__", ""), None) is op:
                return op_id
            raise UnknownOpError(repr(op), [k.rpartition(".")[2] for k in self.all_op_ids()])
        known = self.all_op_ids()
        if op in known:
            return op
        matches = [k for k in known if k.rpartition(".")[2] == op]
        if len(matches) == 1:
            return matches[0]
        raise UnknownOpError(op, [k.rpartition(".")[2] for k in known])

    def get_op(self, op: str | OpLike | Callable[..., Any]) -> OpLike:
        """The :class:`~polykernel.core.op.Op` object for an id or bare name (imports its module once)."""
        op_id = self.resolve_op_id(op)
        hit = self._ops.get(op_id)
        if hit is None:
            importlib.import_module(self.load_catalog()[op_id])
            hit = self._ops[op_id]
        return hit

    def builtin_impls(self, op: str | OpLike) -> list[KernelSpec]:
        """The op's built-in impls as it registered them (before any ``register_impl``)."""
        return list(self._builtin[self.get_op(op).id].values())

    def loaded_op(self, op_id: str) -> OpLike | None:
        """The op registered under ``op_id`` if its module has been imported (a dict read)."""
        return self._ops.get(op_id)

    def loaded_ops(self) -> list[OpLike]:
        """The ops whose modules have been imported so far."""
        return list(self._ops.values())

    def add_op(self, op: OpLike, impls: Sequence[KernelSpec] = ()) -> None:
        """Register an :class:`~polykernel.core.op.Op` (its constructor does) with its built-in
        impls: those the backends' manifests declare for it, and ``impls`` (an op file's own
        table, for the ops whose impls have not moved to the manifests yet)."""
        backends = importlib.import_module(BACKENDS_MODULE)
        declared = backends.declared(op.id)
        clash = sorted({s.impl for s in declared} & {s.impl for s in impls})
        if clash:  # refused whole, before anything of the op registers
            where = "; ".join(f"impl {n} declared both by the op file and by {', '.join(backends.declaring(op.id, n))}" for n in clash)
            raise ValueError(f"{op.id}: {where}: declare it once (in the backend's manifest)")
        impls = [*impls, *declared]
        if op.writes:  # the op writes its arguments, whichever impl runs: each built-in impl is in place
            impls = [_in_place(spec) for spec in impls]
        with self.lock:
            self._ops[op.id] = op
            registered = self._specs.setdefault(op.id, {})
            self._builtin[op.id] = {spec.impl: spec for spec in impls}
            # an impl registered under the same name before the op's module was first imported
            # is the user's explicit choice: the declaration does not overwrite it
            kept = [spec for spec in impls if spec.impl not in registered]
        self.changed(op.id)
        for spec in kept:
            self.register_impl(spec)

    # -- change notification ------------------------------------------------------------------
    def listen(self, fn: Callable[[str | None], None]) -> None:
        """Call ``fn(op_id)`` whenever an op's impls (None: possibly any op's) change."""
        self._listeners.append(fn)

    def changed(self, op_id: str | None = None) -> None:
        """Tell the listeners that ``op_id``'s impls (None: possibly every op's) have changed."""
        for fn in self._listeners:
            fn(op_id)

    # -- impls --------------------------------------------------------------------------------
    def register_impl(self, spec: KernelSpec | None = None, **fields: Any) -> Any:
        """See the module-level :func:`register_impl`."""
        if spec is not None:
            self._store(spec)
            return spec

        def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
            target = f"{fn.__module__}:{fn.__qualname__}"
            made = KernelSpec(target=target, **{**fields, "op": self.resolve_op_id(fields["op"])})
            self._store(made, loaded=fn)
            return fn

        if "op" not in fields or "backend" not in fields:
            raise TypeError("register_impl(...) as a decorator needs op= and backend=")
        KernelBackend(fields["backend"])  # fail at registration, not at first call
        return decorate

    def _store(self, spec: KernelSpec, loaded: Callable[..., Any] | None = None) -> None:
        op_id = self.resolve_op_id(spec.op)
        if op_id != spec.op:
            spec = dataclasses.replace(spec, op=op_id)
        with self.lock:
            self._specs.setdefault(op_id, {})[spec.impl] = spec
            if loaded is not None:
                self._preloaded[(op_id, spec.impl)] = loaded
            else:
                self._preloaded.pop((op_id, spec.impl), None)
        self.changed(op_id)

    def unregister_impl(self, op: str | OpLike, impl: str) -> None:
        """Remove ``op``'s impl named ``impl`` (no error if it is not registered)."""
        op_id = self.resolve_op_id(op)
        with self.lock:
            self._specs.get(op_id, {}).pop(impl, None)
            self._preloaded.pop((op_id, impl), None)
        self.changed(op_id)

    def load_impl(self, spec: KernelSpec) -> Callable[..., Any]:
        """The spec's callable: the decorated function itself, or ``spec.load()``."""
        fn = self._preloaded.get((spec.op, spec.impl))
        return fn if fn is not None else spec.load()

    def declare_op_locations(self, op: str, *modules: str) -> None:
        """Name modules that register impls of ``op``; they are imported on the op's first use."""
        op_id = self.resolve_op_id(op)
        with self.lock:
            known = self._locations.setdefault(op_id, [])
            for m in modules:
                if m not in known:
                    known.append(m)
        self.changed(op_id)

    def undeclare_op_location(self, op: str, module: str) -> None:
        """Forget a declared location of ``op`` (what it registered stays)."""
        op_id = self.resolve_op_id(op)
        with self.lock:
            if module in self._locations.get(op_id, ()):
                self._locations[op_id].remove(module)
            self._imported.discard(module)
            self._import_errors.get(op_id, {}).pop(module, None)
        self.changed(op_id)

    def specs_for(self, op: str | OpLike) -> dict[str, KernelSpec]:
        """Impl name -> spec for an op, after importing every declared location (once each)."""
        the_op = self.get_op(op)
        pending = [m for m in self._locations.get(the_op.id, ()) if m not in self._imported]
        # A module counts as imported only once its import has finished, so a thread that finds
        # nothing pending never sees an op without that module's impls; a thread that finds it
        # pending imports it too, which Python's per-module import lock makes wait for the
        # first's. Not under self.lock: a module imported here may import an op module that
        # another thread is importing, and that one waits for self.lock to register its op.
        importing = getattr(self._importing, "modules", None)  # this thread's
        if importing is None:
            importing = self._importing.modules = set()
        for module in pending:
            if module in self._imported or module in importing:  # done, or our own import re-entering
                continue
            importing.add(module)
            try:
                importlib.import_module(module)
            except Exception as exc:  # recorded and shown by explain, never raised here
                last = traceback.format_exception_only(type(exc), exc)[-1].strip()
                with self.lock:
                    self._import_errors.setdefault(the_op.id, {})[module] = last
            finally:
                importing.discard(module)
                with self.lock:
                    self._imported.add(module)
        return dict(self._specs.get(the_op.id, {}))

    def import_errors(self, op: str | OpLike) -> dict[str, str]:
        """Declared modules of ``op`` that failed to import, with their error line."""
        return dict(self._import_errors.get(self.resolve_op_id(op), {}))

    # -- snapshot -----------------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        """The whole state, copied (see :meth:`restore`)."""
        with self.lock:
            return Snapshot(
                specs={op: dict(table) for op, table in self._specs.items()},
                preloaded=dict(self._preloaded),
                locations={op: list(mods) for op, mods in self._locations.items()},
                imported=frozenset(self._imported),
                import_errors={op: dict(e) for op, e in self._import_errors.items()},
            )

    def restore(self, snap: Snapshot) -> None:
        """Put back a :meth:`snapshot`'s registrations and locations. Ops first imported since
        keep their built-in impls (an op module is imported once per process); ops defined
        since outside the catalog are removed."""
        catalog = self.load_catalog()
        with self.lock:
            for op_id in [o for o in self._ops if o not in snap.specs and o not in catalog]:
                del self._ops[op_id]
                self._specs.pop(op_id, None)
            self._preloaded.clear()
            self._preloaded.update(snap.preloaded)
            for op, table in self._specs.items():
                table.clear()
                if op in snap.specs:
                    table.update(snap.specs[op])
                else:  # first loaded since: the impls it declares
                    table.update(self._builtin.get(op, {}))
            self._locations.clear()
            self._locations.update({op: list(mods) for op, mods in snap.locations.items()})
            self._imported.clear()
            self._imported.update(snap.imported)
            self._import_errors.clear()
            self._import_errors.update({op: dict(e) for op, e in snap.import_errors.items()})
        self.changed(None)


REGISTRY = Registry()


# The module-level API: the one registry's methods.
def _in_place(spec: KernelSpec) -> KernelSpec:
    fmt = spec.format_signature
    return spec if fmt.in_place else dataclasses.replace(spec, format_signature=dataclasses.replace(fmt, in_place=True))


load_catalog = REGISTRY.load_catalog
all_op_ids = REGISTRY.all_op_ids
resolve_op_id = REGISTRY.resolve_op_id
get_op = REGISTRY.get_op
loaded_op = REGISTRY.loaded_op
builtin_impls = REGISTRY.builtin_impls
loaded_ops = REGISTRY.loaded_ops
add_op = REGISTRY.add_op
listen = REGISTRY.listen
changed = REGISTRY.changed
load_impl = REGISTRY.load_impl
declare_op_locations = REGISTRY.declare_op_locations
undeclare_op_location = REGISTRY.undeclare_op_location
specs_for = REGISTRY.specs_for
unregister_impl = REGISTRY.unregister_impl
import_errors = REGISTRY.import_errors
snapshot = REGISTRY.snapshot
restore = REGISTRY.restore


@overload
def register_impl(spec: KernelSpec) -> KernelSpec: ...
@overload
def register_impl(spec: None = None, **fields: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]: ...


def register_impl(spec: KernelSpec | None = None, **fields: Any) -> Any:
    """Register an impl. Use with a :class:`KernelSpec`, or as a decorator factory.

    The decorated function becomes the target; ``op`` may be a bare name. Registering a second
    impl with the same backend name for an op replaces the first (here, inside
    :func:`polykernel.testing.isolated`, only until the block ends).

    >>> import torch, polykernel
    >>> from polykernel.testing import isolated
    >>> with isolated():
    ...     @polykernel.register_impl(op="rms_norm", backend="torch", rank=5)
    ...     def my_rms_norm(x, weight, eps, offset, casting):
    ...         y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    ...         return (y * (offset + weight.float())).to(x.dtype)
    ...     polykernel.rms_norm(torch.randn(2, 8), torch.ones(8), impl="torch").shape
    torch.Size([2, 8])
    """
    return REGISTRY.register_impl(spec, **fields)
