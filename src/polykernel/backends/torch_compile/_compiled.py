"""One op's reference under ``torch.compile(dynamic=True)``, and what compiling it cost.

:class:`Compiled` wraps the function once per op (the impls share it); Dynamo keeps the compiled
graphs (``dynamic=True``: one graph serves every row count and length; it recompiles for a new
dtype, device, grad mode, option value, or a size of 0 or 1, which it specializes). Each call's
class is the op's argument class (``Op.key``) plus which sizes are 0 or 1, so the first call of a
class is known: it is timed (what compiling cost, :meth:`Compiled.compile_ms`, which measured
selection charges), and during a CUDA-graph capture it runs the eager reference instead, since
nothing may compile there. Inside an outer ``torch.compile`` trace the reference itself is
traced (no nested compile).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from ... import timing
from ...core import registry

# Inductor by default; the tests swap in "aot_eager" (Dynamo + AOTAutograd, no codegen) where a
# C++ compile per case would be too slow for the CPU suite.
BACKEND = "inductor"

_lock = threading.RLock()
_ops: dict[str, Compiled] = {}


def _sizes(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Which sizes Dynamo specializes (0 and 1), per tensor argument."""
    return tuple(tuple(s if s < 2 else 2 for s in a.shape) if isinstance(a, torch.Tensor) else None for a in args)


class Compiled:
    """``fn`` (the op's reference, with the impls' positional arguments) under ``torch.compile``."""

    def __init__(self, op_id: str, fn: Callable[..., Any]) -> None:
        self.op_id = op_id
        self.fn = fn
        self._compiled: Callable[..., Any] | None = None
        self._key: Callable[..., tuple[Any, ...]] | None = None
        self._seen: dict[tuple[Any, ...], float] = {}  # (argument class, sizes) -> ms its first call took
        self._classes: set[tuple[Any, ...]] = set()  # argument classes compiled at least once

    def _setup(self) -> None:
        self._key = registry.get_op(self.op_id).key
        self._compiled = torch.compile(self.fn, dynamic=True, backend=BACKEND)

    def __call__(self, *args: Any) -> Any:
        if torch.compiler.is_compiling():  # an outer trace: it compiles the reference with the rest
            return self.fn(*args)
        if self._key is None:
            with _lock:
                if self._key is None:
                    self._setup()
        argkey = self._key(*args)  # type: ignore[misc]
        k = (argkey, _sizes(args))
        if k in self._seen:
            return self._compiled(*args)  # type: ignore[misc]
        if args and isinstance(args[0], torch.Tensor) and args[0].is_cuda and torch.cuda.is_current_stream_capturing():
            return self.fn(*args)  # never compile inside a capture: the eager reference is graph-safe
        with _lock:  # one thread compiles a class; the others wait, then reuse it
            if k in self._seen:
                return self._compiled(*args)  # type: ignore[misc]
            t0 = timing.now()
            out = self._compiled(*args)  # type: ignore[misc]
            self._seen[k] = (timing.now() - t0) * 1e3
            self._classes.add(argkey)
        return out

    def ready(self, argkey: tuple[Any, ...]) -> bool:
        return argkey in self._classes

    def compile_ms(self, *args: Any) -> float | None:
        """What compiling this op cost this process for the arguments' device, or None if it
        never compiled there: the slowest first call of a class, since a fresh process pays a
        whole compile wherever Dynamo's graph for an earlier class happened to serve this one."""
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        times = [ms for (argkey, _), ms in self._seen.items() if argkey[0] == device]
        return max(times) if times else None


def compiled(op_id: str, fn: Callable[..., Any]) -> Compiled:
    """The op's one :class:`Compiled` (created on first use)."""
    with _lock:
        hit = _ops.get(op_id)
        if hit is None:
            hit = _ops[op_id] = Compiled(op_id, fn)
        return hit


def ready(op_id: str, argkey: tuple[Any, ...]) -> bool:
    """Whether this process compiled ``op_id`` for the argument class ``argkey`` (gates ask this
    during a CUDA-graph capture)."""
    hit = _ops.get(op_id)
    return hit is not None and hit.ready(argkey)


def impl(op_id: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """A registered impl: calls the op's compiled reference; ``compile_ms(*args)`` on it tells
    measured selection what its compile costs (see :mod:`polykernel.tuning.measure`)."""

    # looked up per call (one dict read), so that reset() forgets what the impl compiled too
    def run(*args: Any) -> Any:
        return compiled(op_id, fn)(*args)

    run.compile_ms = lambda *args: compiled(op_id, fn).compile_ms(*args)  # type: ignore[attr-defined]
    return run


def reset() -> None:
    """Forget every compiled function and class (tests)."""
    with _lock:
        _ops.clear()
