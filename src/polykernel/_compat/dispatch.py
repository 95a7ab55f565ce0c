"""What the dispatcher's hot path reads on every call: the deterministic, stream-capture, compiling
and autocast flags (bound at import: the hot path reads these module globals), and the hit guard's
TensorGuards class."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from .probe import _probe

# The C function behind torch.are_deterministic_algorithms_enabled (its wrapper costs one more
# Python frame, ~20 ns per call). Same bool: keys built with either are equal.
deterministic_enabled: Callable[[], bool] = _probe(
    "deterministic_enabled", lambda: torch._C._get_deterministic_algorithms, torch.are_deterministic_algorithms_enabled
)

# The C function behind torch.cuda.is_current_stream_capturing (one frame less); asked only for
# CUDA decisions (on a CPU-only build both are stubs that raise).
stream_capturing: Callable[[], bool] = _probe(
    "stream_capturing", lambda: getattr(torch._C, "_cuda_isCurrentStreamCapturing", None), torch.cuda.is_current_stream_capturing
)

is_compiling: Callable[[], bool] = torch.compiler.is_compiling
dynamo_compiling: Callable[[], bool] | None = getattr(torch.compiler, "is_dynamo_compiling", None)  # public since 2.3

# The compile check that generated hot paths inline (polykernel.core.op): Dynamo constant-folds
# `is_dynamo_compiling()` to True while tracing, and non-strict export sets the module flag that
# `is_compiling` reads (one Python frame instead of two, ~50 ns per call). It reads the names the
# generator binds: `dynamo_compiling` (above), `compiler_mod` (torch.compiler), `compiling`.
COMPILING_EXPR: str = _probe(
    "compiling_flag",
    lambda: (
        "dynamo_compiling() or compiler_mod._is_compiling_flag"
        if dynamo_compiling is not None and hasattr(torch.compiler, "_is_compiling_flag")
        else None
    ),
    "compiling()",
)


# -- the dispatcher's hit guard ----------------------------------------------------------------


@functools.cache
def tensor_guards() -> Any:
    """TensorGuards (torch.compile's C++ tensor check; no ``torch._dynamo`` import needed), once it
    has passed a probe of the way :mod:`polykernel.core.hit_guard` calls it; else None."""

    def get() -> Any:
        from torch._C._dynamo.guards import TensorGuards

        t = torch.zeros(2)
        probe = TensorGuards(t, dynamic_dims_sizes=[[None]], dynamic_dims_strides=[[None]])
        sub = torch.nn.Parameter(torch.ones(2), requires_grad=False)  # exact types: hot_path._run_tail counts on it
        if not (probe.check(torch.ones(3)) and not probe.check(t.double()) and not probe.check(t[None]) and not probe.check(sub)):
            raise RuntimeError("TensorGuards checks other metadata than expected")
        return TensorGuards

    return _probe("tensor_guards", get, None)


# -- autocast -----------------------------------------------------------------------------------

_AUTOCAST_DEVICE_TYPES = ("cpu", "cuda", "xpu", "hpu", "mps", "xla", "ipu", "mtia", "maia", "privateuseone")


@functools.cache
def _autocast_device_types() -> tuple[str, ...]:
    def known(device_type: str) -> bool:
        try:
            torch.is_autocast_enabled(device_type)
        except Exception:  # a device type this torch's autocast does not know
            return False
        return True

    return tuple(d for d in _AUTOCAST_DEVICE_TYPES if known(d))


def _any_autocast_by_device() -> bool:
    return any(torch.is_autocast_enabled(d) for d in _autocast_device_types())


# Whether autocast is on for any device type (one C call; the fallback asks each device type).
any_autocast_enabled: Callable[[], bool] = _probe(
    "any_autocast_enabled", lambda: torch._C._is_any_autocast_enabled, _any_autocast_by_device
)
