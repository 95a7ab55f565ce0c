"""Every private torch and Triton API polykernel uses, probed once, each with a fallback.

Private APIs move between releases. polykernel reaches each one only through this module, where it is
probed once (at import, or on first use where the probe needs an import polykernel should not pay up
front) and exposed under a plain name. Where the probe fails, the name holds the fallback: a public API
(a Python frame slower), a slower path, or the feature off. Each is recorded (:func:`fallbacks`), logged once.

``POLYKERNEL_COMPAT_FALLBACKS=1`` forces every fallback, as if each private API were missing
(``make test-fallbacks`` runs the CPU suite so). The hot path reads the callables bound here at
import, as module globals, as fast as before. This module sits in the bottom layer of the import
contract: it imports only :mod:`polykernel.env` (which reads that variable as every boolean is read).

=============================  ============================================  ===========================================
name                           private API                                   fallback
=============================  ============================================  ===========================================
deterministic_enabled          torch._C._get_deterministic_algorithms        torch.are_deterministic_algorithms_enabled
stream_capturing               torch._C._cuda_isCurrentStreamCapturing       torch.cuda.is_current_stream_capturing
COMPILING_EXPR                 torch.compiler._is_compiling_flag (inlined)   ``compiling()`` (torch.compiler.is_compiling)
tensor_guards()                torch._C._dynamo.guards.TensorGuards          None: the argument class built in Python
function_apply(cls)            torch._C._FunctionBase.apply                  None: ``cls.apply``
functorch_transforms_active    torch._C._are_functorch_transforms_active     a Function without setup_context raises
saved_tensors_hooks_active     torch._C._autograd._top_saved_tensors_...     "active" (the check pushes its own hooks)
forward_ad_open                torch.autograd.forward_ad._current_level      every call looks for tangents (unpack_dual)
any_autocast_enabled           torch._C._is_any_autocast_enabled             torch.is_autocast_enabled per device type
delayed_error(message, n)      torch._C._functions.DelayedError              an autograd.Function whose backward raises
cuda_sleep(cycles)             torch.cuda._sleep                             matmuls on a small buffer (calibrated)
cuda_current_device            torch._C._cuda_getDevice                      torch.cuda.current_device
cuda_raw_stream(device)        torch._C._cuda_getCurrentRawStream            torch.cuda.current_stream(device).cuda_stream
triton_jit_function()          triton.runtime.jit.JITFunction (internals)    None: the fast launch path off
triton_runtime_knobs()         triton.knobs.runtime (launch hooks)           None: the fast launch path off
autograd_keys_on()             torch._C._ForceDispatchKeyGuard and the       no guard (fake impls then use each op's
                               dispatch TLS sets                             declared ``outputs``)
with_autograd(fn)              (the same guard)                              ``fn`` on a fresh thread (default TLS)
comptime()                     torch._dynamo.comptime.comptime               None: the caller's fallback (a custom op)
custom_op_overload(op, name)   torch.library.CustomOpDef._opoverload         ``torch.ops.<ns>.<name>.default``
storage_id(t)                  torch.UntypedStorage._cdata                   the storage's data_ptr()
softmax_backward_data(...)     torch._softmax_backward_data                  y * (dy - sum(dy * y)) in torch ops
is_async_collective(t)         torch.distributed._functional_collectives     the class's name
dtensor_schema_infos()         DTensor._op_dispatcher...op_to_schema_info    None: no custom sharding rules
fully_shard()                  torch.distributed._composable.fsdp            (public first; the private one on torch < 2.6)
module_has_hooks(m)            nn.Module._forward_hooks/_forward_pre_hooks   True: left alone (module_hooks_seen: False)
assert_async(cond, message)    torch._assert_async (a device-side assert)    a host check (a sync; no graph capture)
grouped_mm                     torch._grouped_mm                             None: one matmul per expert
=============================  ============================================  ===========================================

Example::

    from polykernel import _compat
    if _compat.tensor_guards() is None: ...     # the hit guard is off here
    _compat.fallbacks()                         # {'tensor_guards': 'forced (POLYKERNEL_COMPAT_FALLBACKS=1)', ...}
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.autograd.forward_ad as _forward_ad

from .. import env

log = logging.getLogger("polykernel")

FORCED: bool = env.flag("POLYKERNEL_COMPAT_FALLBACKS", False)
_FORCED_WHY = "forced (POLYKERNEL_COMPAT_FALLBACKS=1)"

_fallbacks: dict[str, str] = {}  # probe name -> why its fallback is in use

T = TypeVar("T")


def _fell_back(name: str, why: str) -> None:
    """Record (and log once) that ``name`` uses its fallback."""
    if name not in _fallbacks:
        _fallbacks[name] = why
        log.info("polykernel: %s: fallback in use (%s)", name, why)


def _probe(name: str, get: Callable[[], T], fallback: T) -> T:
    """``get()``, or ``fallback`` when forced, when it raises or when it returns None."""
    if FORCED:
        _fell_back(name, _FORCED_WHY)
        return fallback
    try:
        value = get()
    except Exception as exc:  # the private API moved or is missing in this build
        _fell_back(name, f"{type(exc).__name__}: {exc}")
        return fallback
    if value is None:
        _fell_back(name, "missing in this build")
        return fallback
    return value


def fallbacks() -> dict[str, str]:
    """The probes that use their fallback so far, with why (lazy probes appear once asked)."""
    return dict(_fallbacks)


# -- read on every call (bound at import: the hot path reads these module globals) -------------

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


# -- autograd.Function.apply without its Python wrapper ----------------------------------------

_c_apply = _probe("function_apply", lambda: torch._C._FunctionBase.__dict__["apply"], None)


def function_apply(cls: type[torch.autograd.Function]) -> Callable[..., Any] | None:
    """The C entry point of ``cls.apply`` (``_FunctionBase.apply`` bound to ``cls``), or None."""
    if _c_apply is None:
        return None
    try:
        return _c_apply.__get__(None, cls)
    except TypeError:
        return None


class _TransformProbe(torch.autograd.Function):
    """A Function without ``setup_context``: its ``apply`` raises under functorch transforms,
    which take only Functions that define one (torch's documented rule), and runs otherwise."""

    @staticmethod
    def forward(ctx: Any) -> None:  # type: ignore[override]
        return None


def _transforms_active_by_probe() -> bool:
    try:
        _TransformProbe.apply()
    except RuntimeError:  # "... must override the setup_context staticmethod": a transform is on
        return True
    return False


# Whether vmap/grad transforms are active (kernels cannot read their wrapped tensors; the Python
# autograd path is needed). The fallback asks torch.autograd.Function's public behaviour instead
# (~2.5 µs a call instead of ~25 ns).
functorch_transforms_active: Callable[[], bool] = _probe(
    "functorch_transforms_active", lambda: torch._C._are_functorch_transforms_active, _transforms_active_by_probe
)


# Whether saved-tensor hooks are in force (a non-reentrant checkpoint region, save_on_cpu): only
# then does the first-call check push identity hooks of its own (core/verify._isolated), since
# torch.func's grad/vjp refuse to run under any (Liger's chunked losses call grad_and_value: the
# H200, 2026-12-04). The fallback says "in force".
def _hooks_in_force() -> bool:
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


saved_tensors_hooks_active: Callable[[], bool] = _probe(
    "saved_tensors_hooks_active",
    lambda: _hooks_in_force if callable(getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)) else None,
    lambda: True,
)


# Whether a forward-AD dual level is open (``torch.autograd.forward_ad.dual_level``): its dual
# tensors do not require grad, yet their tangents must reach the outputs, which no kernel reading
# raw memory carries (the dispatcher then checks the call's tensors: Op.forward_ad). The level is
# a module global of torch.autograd.forward_ad (-1 when none is open), read as one attribute; the
# generated hot paths inline FORWARD_AD_EXPR, which reads the name ``fwad`` (that module) or
# ``forward_ad_open`` (this function). The fallback says "open" on every call: each call then
# looks for tangents with the public ``unpack_dual`` (~1 µs a tensor).
def _dual_level_open() -> bool:
    return _forward_ad._current_level >= 0


def _dual_level_unknown() -> bool:
    return True


forward_ad_open: Callable[[], bool] = _probe(
    "forward_ad_level",
    lambda: _dual_level_open if type(getattr(_forward_ad, "_current_level", None)) is int else None,
    _dual_level_unknown,
)
FORWARD_AD_EXPR: str = "fwad._current_level >= 0" if forward_ad_open is _dual_level_open else "forward_ad_open()"


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


class _DelayedErrorFunction(torch.autograd.Function):
    """Outputs equal to the inputs whose backward raises ``message`` (DelayedError's behaviour)."""

    @staticmethod
    def forward(ctx: Any, message: str, *xs: Any) -> tuple[Any, ...]:  # type: ignore[override]
        ctx.message = message
        return tuple(None if x is None else x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:  # type: ignore[override]
        raise RuntimeError(ctx.message)


def _delayed_error_function(message: str, n_inputs: int) -> Callable[..., tuple[Any, ...]]:
    return lambda *xs: _DelayedErrorFunction.apply(message, *xs)


# ``delayed_error(message, n)(*xs)``: the ``n`` inputs passed through, with a backward that raises
# ``message`` (torch's own node for a gradient that must not be differentiated again).
delayed_error: Callable[[str, int], Callable[..., tuple[Any, ...]]] = _probe(
    "delayed_error", lambda: torch._C._functions.DelayedError, _delayed_error_function
)


# -- torch.library custom ops -------------------------------------------------------------------


def _autograd_guard_factory() -> Callable[[], Any]:
    C = torch._C
    keys = (
        C.DispatchKey.AutogradFunctionality,
        C.DispatchKey.AutogradOther,
        C.DispatchKey.AutogradNestedTensor,
        C.DispatchKey.ADInplaceOrView,
    )
    exclude_set, include_set, guard = C._dispatch_tls_local_exclude_set, C._dispatch_tls_local_include_set, C._ForceDispatchKeyGuard

    def on() -> Any:
        excluded = exclude_set()
        for k in keys:
            excluded = excluded.remove(k)
        return guard(include_set(), excluded)

    with on():  # the probe: it builds and enters
        pass
    return on


_autograd_guard: Callable[[], Any] | None = _probe("autograd_keys_on", _autograd_guard_factory, None)


def autograd_keys_on() -> contextlib.AbstractContextManager[Any]:
    """A guard that takes autograd's keys out of this thread's excluded dispatch keys (a custom op's
    kernels run below autograd), so that what runs inside dispatches as at the top of a trace.

    Fallback: no guard (:func:`autograd_keys_guarded` says so). What runs inside then dispatches
    below autograd, where FakeTensorMode decomposes composite ops through their Python refs, some
    of them wrong: polykernel's fake impls take their outputs' shapes from each op's declared
    ``outputs`` instead (polykernel.compile.library)."""
    return _autograd_guard() if _autograd_guard is not None else contextlib.nullcontext()


def autograd_keys_guarded() -> bool:
    """Whether :func:`autograd_keys_on` really guards (False: its fallback, no guard)."""
    return _autograd_guard is not None


def _on_fresh_thread(fn: Callable[[], T]) -> T:
    """``fn()`` on a new thread, whose dispatch keys are the defaults (autograd live): the caller's
    context variables and current CUDA stream go along; its grad mode, autocast state and
    TorchDispatch/TorchFunction modes (thread-local) do not."""
    ctx = contextvars.copy_context()
    stream = torch.cuda.current_stream() if torch.cuda.is_initialized() else None
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                box["out"] = ctx.run(fn)
        except BaseException as exc:  # re-raised in the caller
            box["exc"] = exc

    worker = threading.Thread(target=run, name="polykernel-autograd")
    worker.start()
    worker.join()
    if "exc" in box:
        raise box["exc"]
    return box["out"]


def with_autograd(fn: Callable[[], T]) -> T:
    """``fn()`` with autograd recording (grad mode on), also inside a custom op's kernel, where
    autograd's dispatch keys are excluded: under :func:`autograd_keys_on`, or (fallback) on a
    fresh thread, where they are not (~0.1 ms per call more)."""

    def body() -> T:
        with torch.enable_grad():
            return fn()

    if _autograd_guard is None:
        return _on_fresh_thread(body)
    with _autograd_guard():
        return body()


if FORCED:
    _fell_back("comptime", _FORCED_WHY)


def comptime() -> Callable[..., Any] | None:
    """``torch._dynamo.comptime.comptime`` (runs a function while Dynamo traces the caller), or
    None. Called while tracing: it must not log (that would break the graph)."""
    if FORCED:
        return None
    try:
        from torch._dynamo.comptime import comptime as fn
    except ImportError:
        return None
    return fn


def custom_op_overload(custom: Any, qualname: str) -> Any:
    """The ``OpOverload`` of a ``torch.library.custom_op`` named ``qualname`` (``ns::name``)."""
    overload = None if FORCED else getattr(custom, "_opoverload", None)
    if overload is None:
        _fell_back("custom_op_overload", _FORCED_WHY if FORCED else "CustomOpDef._opoverload missing")
        ns, name = qualname.split("::")
        overload = getattr(getattr(torch.ops, ns), name).default
    return overload


def _data_ptr_id(storage: Any) -> int:
    return storage.data_ptr()


def _cdata(storage: Any) -> int:
    return storage._cdata


_storage_key: Callable[[Any], int] = _probe(
    "storage_id", lambda: _cdata if isinstance(_cdata(torch.empty(1).untyped_storage()), int) else None, _data_ptr_id
)


def storage_id(t: torch.Tensor) -> int:
    """An id equal for tensors that share a storage (raises for a tensor without one). Fallback:
    the storage's address, equal for storages over the same memory too (an extra clone at most)."""
    return _storage_key(t.untyped_storage())


def _softmax_backward_formula(dy: torch.Tensor, y: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    dy, y = dy.to(dtype), y.to(dtype)
    return y * (dy - (dy * y).sum(dim, keepdim=True))


softmax_backward_data: Callable[[torch.Tensor, torch.Tensor, int, torch.dtype], torch.Tensor] = _probe(
    "softmax_backward_data", lambda: torch._softmax_backward_data, _softmax_backward_formula
)


# -- torch.distributed --------------------------------------------------------------------------

if FORCED:
    _fell_back("is_async_collective", _FORCED_WHY)


def is_async_collective(t: Any) -> bool:
    """Whether ``t`` is functional collectives' ``AsyncCollectiveTensor`` (its storage is not its
    data until waited on). Looked up only if that module is loaded; fallback: by class name."""
    if not FORCED:
        fc = sys.modules.get("torch.distributed._functional_collectives")
        act = getattr(fc, "AsyncCollectiveTensor", None)
        if act is not None:
            return type(t) is act
    return type(t).__name__ == "AsyncCollectiveTensor" and callable(getattr(t, "wait", None))


@functools.cache
def dtensor_schema_infos() -> dict[Any, Any] | None:
    """DTensor's per-op schema infos (``RuntimeSchemaInfo``: which arguments its strategy cache
    keys on), which polykernel.compile.sharding widens to every argument. None: that cannot be
    done, and custom sharding rules are not registered (they could share a cached strategy
    between calls that differ in an option)."""

    def get() -> Any:
        from torch.distributed.tensor import DTensor

        infos = DTensor._op_dispatcher.sharding_propagator.op_to_schema_info
        return infos if isinstance(infos, dict) else None

    return _probe("dtensor_schema_infos", get, None)


def fully_shard() -> Callable[..., Any]:
    """FSDP2's ``fully_shard``: public since torch 2.6, before that a private module."""
    try:
        from torch.distributed.fsdp import fully_shard as fn
    except ImportError:
        if FORCED:
            raise
        from torch.distributed._composable.fsdp import fully_shard as fn
    return fn


# -- torch.nn -----------------------------------------------------------------------------------

_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks")
_hooks_readable: bool = _probe(
    "module_has_hooks", lambda: all(isinstance(getattr(torch.nn.Module(), n), dict) for n in _HOOK_DICTS) or None, False
)


def module_has_hooks(m: torch.nn.Module) -> bool:
    """Whether forward (pre-)hooks are set on ``m`` itself. Fallback: True (cannot tell: callers
    that would bypass ``m``'s forward leave it alone)."""
    return not _hooks_readable or any(getattr(m, n, None) for n in _HOOK_DICTS)


def module_hooks_seen(m: torch.nn.Module) -> bool:
    """:func:`module_has_hooks` with the other fallback, False: callers whose fused path ran past
    ``m`` before they looked keep it."""
    return _hooks_readable and any(getattr(m, n, None) for n in _HOOK_DICTS)


# The kernels' private APIs (CUDA, Triton, MoE) live in .kernels, which probes them through
# _probe above (so it is imported last); their names here are the same objects.
from . import kernels as _kernels  # noqa: E402

cuda_sleep = _kernels.cuda_sleep
cuda_current_device = _kernels.cuda_current_device
cuda_raw_stream = _kernels.cuda_raw_stream
triton_jit_function = _kernels.triton_jit_function
triton_runtime_knobs = _kernels.triton_runtime_knobs
assert_async = _kernels.assert_async
grouped_mm = _kernels.grouped_mm
_busy_matmuls = _kernels._busy_matmuls
_clock_khz = _kernels._clock_khz
_public_raw_stream = _kernels._public_raw_stream
