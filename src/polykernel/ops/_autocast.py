"""Ops under ``torch.autocast``: what the equivalent torch code computes there.

Autocast lowers torch's matmuls (``mm``, ``F.linear``, ``@``) to its dtype and leaves elementwise
math alone. The fused linear ops (an LM head fused with its loss) take their heads' matmuls as
``F.linear`` under autocast computes them: hidden states, weight and bias in autocast's dtype
(fp64 as it is, as autocast leaves it; the casts differentiable), then the op on those with
autocast off, so that no matmul of the op's own fp32 math is lowered behind its back (a kernel
reading a lowered logit buffer as fp32 returned garbage). Under ``torch.compile`` the custom op
runs with autocast off: the op's ``autocast`` hook (:func:`linear_args`) casts the same
arguments at trace time, so a compiled call computes what an eager one does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from .. import _compat

_any_autocast = _compat.any_autocast_enabled
any_autocast = _any_autocast  # whether any autocast is on: one C call, the public functions' test


def enabled(device_type: str) -> bool:
    """Whether autocast is on for ``device_type`` (False for a type autocast does not know)."""
    if not _any_autocast():  # one C call: the common case
        return False
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:
        return False


def off(device_type: str) -> contextlib.AbstractContextManager[Any]:
    """Autocast off for ``device_type`` (nothing to turn off for a type autocast does not know)."""
    try:
        return torch.autocast(device_type, enabled=False)
    except RuntimeError:
        return contextlib.nullcontext()


def as_linear(device_type: str, *tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """``tensors`` as ``F.linear`` under autocast on ``device_type`` computes them: floating ones
    in autocast's dtype, fp64 ones (which autocast leaves) and None as they are."""
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t if t is None or t.dtype in (dtype, torch.float64) or not t.is_floating_point() else t.to(dtype) for t in tensors)


def linear_args(*positions: int) -> Callable[[tuple[Any, ...]], tuple[Any, ...]]:
    """An op's ``autocast`` hook: its arguments with those at ``positions`` (the heads' hidden
    states, weights and biases) cast by :func:`as_linear` when autocast is on for the first one's
    device, else unchanged."""

    def cast(args: tuple[Any, ...]) -> tuple[Any, ...]:
        first = args[positions[0]]
        if not isinstance(first, torch.Tensor) or not enabled(first.device.type):
            return args
        new = dict(zip(positions, as_linear(first.device.type, *(args[i] for i in positions))))
        return tuple(new.get(i, a) for i, a in enumerate(args))

    return cast


HEADS = ("hidden", "weight", "bias", "ref_hidden", "ref_weight", "ref_bias", "student_hidden", "student_weight", "teacher_hidden",
         "teacher_weight")  # fmt: skip


def head_args(reference: Callable[..., Any]) -> Callable[[tuple[Any, ...]], tuple[Any, ...]]:
    """:func:`linear_args` at the positions of ``reference``'s head parameters (:data:`HEADS`)."""
    import inspect

    names = list(inspect.signature(reference).parameters)
    return linear_args(*(i for i, name in enumerate(names) if name in HEADS))


_compiling = torch.compiler.is_compiling


def dispatch(op: Any, dispatch_fn: Callable[..., Any], impl: Any, args: tuple[Any, ...]) -> Any:
    """``dispatch_fn(impl, *args)`` for a fused linear op's public function, which calls this when
    any autocast is on: the heads cast by the op's ``autocast`` hook, then :func:`without`. Under
    torch.compile the compiled call casts (the hook, at trace time)."""
    if _compiling():
        return dispatch_fn(impl, *args)
    return without(dispatch_fn, impl, op.autocast(args))


def without(dispatch_fn: Callable[..., Any], impl: Any, args: tuple[Any, ...]) -> Any:
    """``dispatch_fn(impl, *args)`` on heads already cast, with autocast off for their device, so
    that every impl, a peer's too (whose matmuls autocast would otherwise lower, each its own way),
    computes the same thing."""
    first = args[0]
    if _compiling() or not isinstance(first, torch.Tensor):  # (a non-tensor: validation names it)
        return dispatch_fn(impl, *args)
    with off(first.device.type):
        return dispatch_fn(impl, *args)
