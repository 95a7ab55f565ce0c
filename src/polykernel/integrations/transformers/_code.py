"""Copies of transformers' functions whose code sees other globals: how a patched forward calls
polykernel's rotary function (or mask builders) without changing the modeling module."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any


class _CannotPatch(Exception):
    pass


def _global_names(code: types.CodeType) -> set[str]:
    """The globals ``code`` may read, its nested functions' included (Llama4TextModel.forward
    builds its masks in lambdas; they are made at run time with the copy's globals too)."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def _with_globals(fn: Callable, old: dict, new: dict, calls: tuple[str, ...] = ("apply_rotary_pos_emb",)) -> types.FunctionType:
    """A copy of ``fn`` whose code sees ``new`` instead of the module globals ``old``; its code
    must name one of ``calls`` (the globals the copy exists to replace).

    Decorators made with ``functools.wraps`` (``fn.__wrapped__`` held in the wrapper's closure)
    are copied too, so the copy behaves like ``fn`` in every other way.
    """
    if not isinstance(fn, types.FunctionType):
        raise _CannotPatch(f"{fn!r} is not a Python function")
    inner = fn.__dict__.get("__wrapped__")
    closure = fn.__closure__
    if inner is not None:
        new_inner = _with_globals(inner, old, new, calls)
        cells, found = [], False
        for cell in closure or ():
            try:
                held = cell.cell_contents
            except ValueError:  # empty cell
                held = None
            if held is inner:
                cells.append(types.CellType(new_inner))
                found = True
            else:
                cells.append(cell)
        if not found:
            raise _CannotPatch(f"decorator {fn.__qualname__} does not hold the function it wraps in its closure")
        closure = tuple(cells)
    elif fn.__globals__ is not old:
        raise _CannotPatch(f"{fn.__qualname__} is not defined in the modeling module")
    elif not any(name in _global_names(fn.__code__) for name in calls):
        raise _CannotPatch(f"{fn.__qualname__} does not call {' or '.join(calls)}")
    out = types.FunctionType(fn.__code__, new if fn.__globals__ is old else fn.__globals__, fn.__name__, fn.__defaults__, closure)
    out.__kwdefaults__ = fn.__kwdefaults__
    out.__dict__.update(fn.__dict__)
    out.__qualname__, out.__module__, out.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
    if inner is not None:
        out.__wrapped__ = new_inner  # type: ignore[attr-defined]
    return out


def _namespace(module_globals: dict, **overrides: Any) -> dict:
    """Globals for :func:`_with_globals`: ``module_globals`` with ``overrides``, without
    ``__name__``. torch.compile (dynamo) finds the globals of a frame through the module that
    ``__name__`` names, so it would guard on the module's own functions, not the ones the copy
    calls (and fail to build a guard where their closures differ); without it, dynamo guards on
    this dict itself."""
    ns = {**module_globals, **overrides}
    ns.pop("__name__", None)
    return ns
