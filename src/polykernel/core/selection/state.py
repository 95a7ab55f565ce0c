"""The selection layer's process state: settings, fault marks, once-only log records, the env
check and strict mode (the record of decisions lives beside its class, in ``resolution``).
Mutated in place only (other modules and tests hold these objects), never rebound."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch

from ... import _compat, env
from .. import registry

log = logging.getLogger("polykernel")

# Scope entries, innermost last: (op id or None, impl names). A tuple, so it can be a memo key.
_scope: ContextVar[tuple[tuple[str | None, tuple[str, ...]], ...]] = ContextVar("polykernel_scope", default=())
SCOPE = _scope  # the ContextVar itself: the hot path reads it (core.op)
_global: dict[str | None, tuple[str, ...]] = {}
_broken: dict[tuple[str, tuple[Any, ...]], dict[str, str]] = {}
_logged: set[tuple[Any, ...]] = set()
_lock = threading.RLock()
# Bumped (under _lock) before the memos are cleared: a decision resolved against the settings and
# impls of an older generation runs for the call that made it, and is never kept (see decide).
# [0] counts the changes that may touch every op (settings, clear_caches); _op_generation one op's
# own (its impls registered): an impl module that registers another op on its first import
# (backends/triton/kl_div.py imports ops/cross_entropy.py) must not make the decision that loads
# it stale, else its next call decides and checks it again (the H100, 2026-12-07: fused_linear_jsd's
# second call ran the first-call check again, benchmarks/results/h100-2026-12-07-twentyfifth/).
_generation = [0]
_op_generation: dict[str, int] = {}


def generation(op_id: str | None = None) -> int:
    """The generation that a decision of ``op_id`` is resolved in: it changes whenever a change
    to the settings, or to that op's impls, may change the decision (never otherwise)."""
    return _generation[0] + (_op_generation.get(op_id, 0) if op_id is not None else 0)


def strict_mode() -> bool:
    # Read on slow paths only (a new decision, a runtime fault): a bad value raises there.
    return env.flag("POLYKERNEL_STRICT", False)


_env_checked = False  # env.check ran since the last clear_caches (it warns of misspelt names)


def _check_env() -> None:
    global _env_checked
    if not _env_checked:
        with _lock:  # threads meeting their first decisions at once warn once
            if not _env_checked:
                env.check([op_id.rpartition(".")[2] for op_id in registry.all_op_ids()], strict_mode())
                _check_tuning_settings()
                _env_checked = True  # not before: under strict mode every decision raises until fixed


def _check_tuning_settings() -> None:
    """Parse the numeric tuning variables now: a bad ``POLYKERNEL_TUNE_MARGIN`` or
    ``POLYKERNEL_TUNE_CALLS`` fails the first op call (a ``ValueError`` naming it), not a
    measurement hours later, and not never (they are otherwise read only when a key is measured)."""
    from ... import tuning

    tuning.margin()
    tuning.calls()


def reset_env_check() -> None:
    """Make the next decision run :func:`polykernel.env.check` again (``clear_caches``)."""
    global _env_checked
    _env_checked = False


def log_once(key: tuple[Any, ...], message: str) -> None:
    """Log ``message`` the first time ``key`` is seen in this process (``clear_caches`` forgets).

    Callable from code torch.compile traces: Dynamo cannot trace a logger call (fullgraph fails on
    it), so there the call runs while Dynamo traces, once per compilation, which is when the
    decision it reports is baked into the graph. ``key`` and ``message`` must then be constants."""
    if _traced():
        _while_tracing(key, message, False)
    else:
        _report(key, message, False)


def fallback_once(key: tuple[Any, ...], message: str) -> None:
    """A fallback: a ``RuntimeError`` carrying ``message`` under ``POLYKERNEL_STRICT=1``, else
    :func:`log_once`. Under torch.compile the error too is raised while Dynamo traces (raised in
    the traced code, fullgraph reports only "Observed exception", not the message)."""
    if _traced():
        _while_tracing(key, message, True)
    else:
        _report(key, message, True)


def _traced() -> bool:
    """Whether Dynamo is tracing the caller's code (not: Python it runs while tracing, such as a
    comptime function or a fake impl, where ``torch.compiler.is_compiling()`` is True too)."""
    dynamo = _compat.dynamo_compiling
    return dynamo() if dynamo is not None else torch.compiler.is_compiling()


# While ``explain`` resolves a call: the lines the call would log, collected for its answer instead
# of logged (logging them would mark them seen, and the call itself would then log nothing).
_collecting: ContextVar[list[str] | None] = ContextVar("polykernel_explain_notes", default=None)


@contextmanager
def collected_notes() -> Iterator[list[str]]:
    """Collect the lines :func:`log_once` would log in this block, unlogged and not marked seen."""
    notes: list[str] = []
    token = _collecting.set(notes)
    try:
        yield notes
    finally:
        _collecting.reset(token)


def first_time(key: tuple[Any, ...]) -> bool:
    """Whether ``key`` is new to the once-only records (it is recorded now). One check and add
    for threads meeting one key at once: a line is logged once, not by each of them."""
    with _lock:
        if key in _logged:
            return False
        _logged.add(key)
        return True


def _report(key: tuple[Any, ...], message: str, strict_raises: bool) -> None:
    if strict_raises and strict_mode():
        raise RuntimeError(message)
    notes = _collecting.get()
    if notes is not None:
        if message not in notes:
            notes.append(message)
        return
    if first_time(key):
        log.warning(message)


def _while_tracing(key: tuple[Any, ...], message: str, strict_raises: bool) -> None:
    comptime = _compat.comptime()
    if comptime is not None:
        comptime(_from_trace)
    elif strict_raises and strict_mode():  # (the message is lost under fullgraph)
        raise RuntimeError(message)
    # else no way to run code while Dynamo traces on this torch: not logged (it would break the graph)


def _from_trace(ctx: Any) -> None:  # run by Dynamo while tracing _while_tracing; no free variables
    _report(*(ctx.get_local(name).as_python_constant() for name in ("key", "message", "strict_raises")))


# Ops whose tensor-subclass arguments a layer above routes itself (polykernel.distributed.dtensor adds its ops
# when a DTensor is first seen, then clears the memos): their decisions all take the subclass
# check, so a DTensor never reaches even a torch impl directly. Empty, and free, until then.
routed: set[str] = set()
