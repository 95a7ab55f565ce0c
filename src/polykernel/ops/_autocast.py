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
