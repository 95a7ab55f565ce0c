"""A leaner ``autograd.Function.apply`` for the Triton impls' autograd nodes.

``Function.apply`` is a Python classmethod around the C entry point: it binds default arguments
for ``setup_context``-style Functions and unwraps dead functorch wrappers, then calls the C
``_FunctionBase.apply``. For a classic Function (``forward(ctx, ...)``) outside functorch
transforms, neither step does anything, yet the wrapper costs a few microseconds of host time
per call (6 µs on the small-CPU dev machine). ``lean_apply(cls)`` goes straight to the C entry
point in that case and through ``cls.apply`` otherwise (vmap/grad transforms active, a
``setup_context`` Function, or a torch whose internals differ). :func:`set_enabled` (or
``POLYKERNEL_LEAN_APPLY=0``) sends every call through ``cls.apply``: benchmarks A/B the two.

Example::

    _rms_apply = lean_apply(_RMSNorm)
    y = _rms_apply(x, weight, eps, offset, casting)   # same as _RMSNorm.apply(...)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ... import _compat, env

# Read per call (one global load): benchmarks/host/host_diag.py measures with the lean path off.
ENABLED = env.flag("POLYKERNEL_LEAN_APPLY", True)

# functorch transforms (vmap, grad) active: the impls then hand the call to their torch impl, since
# kernels cannot read the transforms' wrapped tensors (one thread-local read, ~20 ns; polykernel._compat).
transforms_active: Callable[[], bool] = _compat.functorch_transforms_active


def set_enabled(on: bool) -> bool:
    """Turn the lean path on or off in this process; returns the old setting.

    >>> old = set_enabled(False)   # every lean_apply now calls cls.apply
    >>> _ = set_enabled(old)
    """
    global ENABLED
    old, ENABLED = ENABLED, bool(on)
    return old


def lean_apply(cls: type[torch.autograd.Function]) -> Callable[..., Any]:
    """``cls.apply`` without its Python wrapper where that wrapper is a no-op (see module doc)."""
    c_apply = _compat.function_apply(cls)
    transforms_active = _compat.functorch_transforms_active
    if c_apply is None:  # another torch: the public path
        return cls.apply
    if cls.setup_context is not torch.autograd.Function.setup_context:  # defaults must be bound
        return cls.apply

    def apply(*args: Any) -> Any:
        if not ENABLED or transforms_active():  # functorch (vmap, grad) needs the Python path
            return cls.apply(*args)
        return c_apply(*args)

    return apply
