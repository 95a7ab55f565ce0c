"""Another impl of an op, called by its registered name: how a backend hands over the cases its
kernel does not take (empty tensors, functorch transforms, an option it lacks) without importing
another backend's package (the backends are independent: ``[tool.importlinter]`` in pyproject.toml).

:func:`registered` names an op's impl (by default ``"torch"``, the fallback every op has); the
name is resolved through the registry on the first call (``specs_for(op)[name]``, then
``load_impl``), and the function it gives is kept::

    _torch_rms_norm = registered("norm.rms_norm")  # at import: nothing resolved, nothing imported

    def rms_norm(x, weight, eps, offset, casting):
        if x.numel() == 0:
            return _torch_rms_norm(x, weight, eps, offset, casting)  # the torch impl's signature
        ...

The kept function is dropped whenever the registry says the op's impls changed
(``register_impl``, ``unregister_impl``, ``restore``: its ``listen`` hook), so a re-registered
impl is followed and a removed one is a clear error, never a stale call. Nothing here runs on a
kernel's own path: the cost is the fallback's, one attribute read once resolved. Torch-free.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from ..core import registry
from ..errors import UnknownImplError

__all__ = ["RegisteredImpl", "registered"]

_lock = threading.Lock()
_made: dict[tuple[str, str], RegisteredImpl] = {}
_listening = False


class RegisteredImpl:
    """The impl registered as ``name`` for ``op_id``, called like it (see :func:`registered`)."""

    __slots__ = ("_fn", "_gen", "_op", "name", "op_id")

    def __init__(self, op_id: str, name: str) -> None:
        self.op_id = op_id
        self.name = name
        self._fn: Callable[..., Any] | None = None
        self._op = op_id  # the resolved op id (the same for a full id such as "norm.rms_norm")
        self._gen = 0  # bumped on every change of the op's impls: a resolution begun before one is not kept

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fn = self._fn
        if fn is None:
            fn = self.resolve()
        return fn(*args, **kwargs)

    def resolve(self) -> Callable[..., Any]:
        """The registered impl's function now (imports its module if not yet imported)."""
        fn = self._fn
        if fn is not None:
            return fn
        _listen()
        self._op = registry.resolve_op_id(self.op_id)
        gen = self._gen
        specs = registry.specs_for(self._op)
        spec = specs.get(self.name)
        if spec is None:
            raise UnknownImplError(self._op, self.name, sorted(specs), where="a backend's fallback (polykernel.backends._fallback)")
        fn = registry.load_impl(spec)
        with _lock:
            if self._gen == gen:  # else the op's impls changed meanwhile: resolve again next call
                self._fn = fn
        return fn

    def forget(self) -> None:
        """Drop the resolved function (the next call resolves again)."""
        with _lock:
            self._gen += 1
            self._fn = None

    def __repr__(self) -> str:
        state = "resolved" if self._fn is not None else "not resolved yet"
        return f"registered({self.op_id!r}, {self.name!r}) ({state})"


def registered(op_id: str, name: str = "torch") -> RegisteredImpl:
    """A callable that runs the impl registered as ``name`` for ``op_id`` (a full id such as
    ``"norm.rms_norm"``), with that impl's signature. Resolved on the first call, not here: the
    calling module imports no other backend. A name the op has no impl under raises
    :class:`~polykernel.errors.UnknownImplError` (naming the op, the name and the op's impls) on
    that call. One object per (op, name)."""
    key = (op_id, name)
    with _lock:
        made = _made.get(key)
        if made is None:
            made = _made[key] = RegisteredImpl(op_id, name)
    return made


def _changed(op_id: str | None) -> None:
    """The registry's listener: forget what was resolved for ``op_id`` (None: for every op)."""
    with _lock:
        made = list(_made.values())
    for impl in made:
        if op_id is None or op_id == impl._op:
            impl.forget()


def _listen() -> None:
    """Hear the registry's changes (once, on the first resolution: importing this module costs nothing)."""
    global _listening
    with _lock:
        if not _listening:
            registry.listen(_changed)  # appends to a list: never calls back into this module here
            _listening = True
