"""The autograd internals polykernel's Functions lean on: ``Function.apply``'s C entry point,
whether functorch transforms, saved-tensor hooks or a forward-AD level are active, a node whose
backward raises, and softmax's backward formula."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.autograd.forward_ad as _forward_ad

from .probe import _probe

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


# -- functorch transforms, saved-tensor hooks, forward AD ---------------------------------------


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


# -- backward nodes and formulas ------------------------------------------------------------------


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


def _softmax_backward_formula(dy: torch.Tensor, y: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    dy, y = dy.to(dtype), y.to(dtype)
    return y * (dy - (dy * y).sum(dim, keepdim=True))


softmax_backward_data: Callable[[torch.Tensor, torch.Tensor, int, torch.dtype], torch.Tensor] = _probe(
    "softmax_backward_data", lambda: torch._softmax_backward_data, _softmax_backward_formula
)
