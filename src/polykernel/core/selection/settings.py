"""Public controls: ``use_impl`` scopes, ``set_impl`` settings, and clearing the caches."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence

from ... import env
from .. import registry
from .names import _parse_names, _parse_op_names
from .resolution import _record
from .state import _broken, _generation, _global, _lock, _logged, _op_generation, _scope, reset_env_check


@contextlib.contextmanager
def use_impl(impl: str | Sequence[str], op: str | None = None) -> Iterator[None]:
    """Scoped override for this thread/task (a ContextVar).

    With ``op`` the choice is strict for that op; without, it is a preference list applied to
    every op that has the impl (ops without it keep their normal choice).

    >>> import torch, polykernel
    >>> x, w = torch.randn(4, 8), torch.ones(8)
    >>> with polykernel.use_impl("torch"):  # preferred wherever an op has it
    ...     y = polykernel.rms_norm(x, w)
    >>> polykernel.decisions("rms_norm")[-1]["source"], polykernel.decisions("rms_norm")[-1]["impl"]
    ('scope', 'torch')
    >>> with polykernel.use_impl("torch", op="rms_norm"):  # strict: that impl or ImplNotAvailableError
    ...     y = polykernel.rms_norm(x, w)
    """
    op_id = registry.resolve_op_id(op) if op is not None else None
    names = _parse_names(impl, "use_impl") if op_id is None else _parse_op_names(impl, "use_impl", op_id)
    token = _scope.set((*_scope.get(), (op_id, names)))
    try:
        yield
    finally:
        _scope.reset(token)


def set_impl(impl: str | Sequence[str] | None, op: str | None = None) -> None:
    """Process-wide choice (step 4 of the order). ``set_impl(None)`` resets it.

    ``set_impl("triton")`` prefers Triton wherever an op has it; ``set_impl("torch", op="softmax")``
    forces one op (strict). ``set_impl(None, op="softmax")`` resets that op only.

    >>> import torch, polykernel
    >>> polykernel.set_impl("torch", op="softmax")
    >>> _ = polykernel.softmax(torch.randn(2, 8))
    >>> polykernel.decisions("softmax")[-1]["impl"]
    'torch'
    >>> polykernel.set_impl(None, op="softmax")  # back to the automatic choice
    """
    op_id = registry.resolve_op_id(op) if op is not None else None
    with _lock:
        if impl is None:
            if op_id is None:
                _global.clear()
            else:
                _global.pop(op_id, None)
        else:
            names = _parse_names(impl, "set_impl") if op_id is None else _parse_op_names(impl, "set_impl", op_id)
            _global[op_id] = names
    clear_memos()


def forced_for(op_id: str) -> str | None:
    """What names one impl for ``op_id`` alone, as selection would read it now (a ``use_impl(op=)``
    scope of this context, ``POLYKERNEL_IMPL_<OP>``, ``set_impl(op=)``), or None. The compiled path
    reports such a choice for an op that decomposes under torch.compile, where no impl runs."""
    if any(scope_op == op_id for scope_op, _ in _scope.get()):
        return "use_impl(op=...)"
    op = registry.loaded_op(op_id)
    if op is not None and os.environ.get(f"POLYKERNEL_IMPL_{op.name.upper()}"):
        return f"POLYKERNEL_IMPL_{op.name.upper()}"
    if op_id in _global:
        return "set_impl(op=...)"
    return None


def restore_impl_settings(settings: dict[str | None, tuple[str, ...]]) -> None:
    """Put back what :func:`get_impl_settings` returned (and clear the memo)."""
    with _lock:
        _global.clear()
        _global.update(settings)
    clear_caches()


def get_impl_settings() -> dict[str | None, tuple[str, ...]]:
    """The current ``set_impl`` settings (op id or None -> names)."""
    return dict(_global)


def clear_caches() -> None:
    """Forget memoized decisions, runtime-fault marks and once-only log records.

    >>> import torch, polykernel
    >>> _ = polykernel.rms_norm(torch.randn(2, 8), torch.ones(8))
    >>> polykernel.clear_caches()
    >>> polykernel.decisions()  # the next call decides afresh
    []
    """
    reset_env_check()
    env.reset_warnings()
    with _lock:
        _broken.clear()
        _logged.clear()
        _record.clear()
    clear_memos()
    try:
        from ... import tuning

        tuning.clear_cache()
    except ImportError:
        pass


def clear_memos(op_id: str | None = None) -> None:
    """Drop memoized decisions: of ``op_id`` only (its impls changed), or of every op (None).
    The record that :func:`decisions` reads is kept: it lists what ran since ``clear_caches``."""
    with _lock:  # first: a decision another thread is resolving now is then not memoized
        if op_id is None:
            _generation[0] += 1
        else:  # that op's decisions alone go stale
            _op_generation[op_id] = _op_generation.get(op_id, 0) + 1
    if op_id is not None:
        op = registry.loaded_op(op_id)
        if op is not None:
            op.clear()
        return
    for op in registry.loaded_ops():
        op.clear()


registry.listen(clear_memos)
