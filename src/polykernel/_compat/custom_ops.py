"""What polykernel's ``torch.library`` custom ops need of torch's internals: autograd inside a
custom op's kernel (its dispatch keys put back, or a fresh thread), Dynamo's ``comptime``, and a
custom op's ``OpOverload``."""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from .probe import _FORCED_WHY, FORCED, _fell_back, _probe

T = TypeVar("T")


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
