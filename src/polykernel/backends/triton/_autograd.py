"""A leaner ``autograd.Function.apply`` for the Triton impls' autograd nodes.

``Function.apply`` is a Python classmethod around the C entry point: it binds default arguments
for ``setup_context``-style Functions and unwraps dead functorch wrappers, then calls the C
``_FunctionBase.apply``. For a classic Function (``forward(ctx, ...)``) outside functorch
transforms, neither step does anything, yet the wrapper costs a few microseconds of host time
per call (6 µs on the small-CPU dev machine). ``lean_apply(cls)`` goes straight to the C entry
point in that case and through ``cls.apply`` otherwise (vmap/grad transforms active, a
``setup_context`` Function, or a torch whose internals differ).

Example::

    _rms_apply = lean_apply(_RMSNorm)
    y = _rms_apply(x, weight, eps, offset, casting)   # same as _RMSNorm.apply(...)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def lean_apply(cls: type[torch.autograd.Function]) -> Callable[..., Any]:
    """``cls.apply`` without its Python wrapper where that wrapper is a no-op (see module doc)."""
    try:
        c_apply = torch._C._FunctionBase.__dict__["apply"].__get__(None, cls)
        transforms_active = torch._C._are_functorch_transforms_active
    except (AttributeError, KeyError, TypeError):  # another torch: the public path
        return cls.apply
    if cls.setup_context is not torch.autograd.Function.setup_context:  # defaults must be bound
        return cls.apply

    def apply(*args: Any) -> Any:
        if transforms_active():  # functorch (vmap, grad): its wrappers need the Python path
            return cls.apply(*args)
        return c_apply(*args)

    return apply
