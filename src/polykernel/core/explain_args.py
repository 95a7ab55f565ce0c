"""What ``explain`` needs of a call's arguments, so that it reports what the real call would do:
``dtype=``/``device=`` given by name, the arguments bound as the public function binds them (a
missing one raises the ``TypeError`` the call would), and the op's own validation run on them,
or on stand-in arguments when only a dtype is given (an int dtype on a floating-only op).

Off the hot path: only ``explain`` and ``available_impls`` come here.
"""

from __future__ import annotations

import inspect
import sys
from typing import TYPE_CHECKING, Any

from ..errors import OpArgumentError, OpTypeError, shown

if TYPE_CHECKING:
    from .protocols import OpLike

__all__ = ["call_args", "device_arg", "dtype_arg", "rejection"]


# ``explain(dtype=...)`` also takes a name, as the command line and configs spell them.
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp64": "float64"}
_DTYPES_SHOWN = (
    "'bf16', 'bfloat16', 'fp16', 'float16', 'fp32', 'float32', 'fp64', 'float64' (or a torch dtype's name, e.g. 'torch.bfloat16')"
)


def dtype_arg(op: OpLike, dtype: Any) -> Any:
    """``dtype=`` of explain/available_impls: a ``torch.dtype``, a name of one, or None."""
    import torch

    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if not isinstance(dtype, str):
        raise OpTypeError(op.id, "dtype", f"expected a torch.dtype or one of {_DTYPES_SHOWN}, got {shown(dtype)}")
    name = dtype.strip().lower().removeprefix("torch.")
    found = getattr(torch, _DTYPE_ALIASES.get(name, name), None) if name.isidentifier() else None
    if not isinstance(found, torch.dtype):
        raise OpArgumentError(op.id, "dtype", f"{shown(dtype)} is not a dtype; expected a torch.dtype or one of {_DTYPES_SHOWN}")
    return found


def device_arg(op: OpLike, device: Any) -> Any:
    import torch

    try:
        return torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise OpArgumentError(op.id, "device", f"{shown(device)} is not a device ({str(exc).splitlines()[0]})") from None


def _module_of(op: OpLike) -> Any:
    """The module that defines ``op`` (its reference): the catalog's op files hold the public
    function (named as the op) and ``validate`` there. None for an op defined elsewhere."""
    return sys.modules.get(getattr(op.reference, "__module__", ""))


def call_args(op: OpLike, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """``explain``'s arguments as the public call binds them, in the impls' positional order (the
    reference's, defaults filled in). A call the public function would refuse (a missing
    argument, an unknown keyword) raises the ``TypeError`` it would, naming the op."""
    public = getattr(_module_of(op), op.name, None)
    ref = inspect.signature(op.reference)
    sig = inspect.signature(public) if callable(public) else ref
    params = [p for p in sig.parameters.values() if p.name != "impl"]
    try:
        bound = sig.replace(parameters=params).bind(*args, **kwargs)
    except TypeError as exc:
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        missing = [
            p.name
            for i, p in enumerate(params)
            if p.default is p.empty and p.kind in positional and i >= len(args) and p.name not in kwargs
        ]
        if missing:  # worded as Python words it for the public function
            quoted = [repr(n) for n in missing]
            names = quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])}{',' if len(quoted) > 2 else ''} and {quoted[-1]}"
            plural = "s" if len(missing) > 1 else ""
            raise TypeError(f"{op.name}() missing {len(missing)} required positional argument{plural}: {names}") from None
        raise TypeError(f"{op.name}(): {exc}") from None
    return tuple(bound.arguments.get(p.name, p.default) for p in ref.parameters.values())


def rejection(op: OpLike, args: tuple[Any, ...] | None, dtype: Any) -> Exception | None:
    """The op's own validation of a call, as the real call runs it before choosing an impl.

    ``args``: the call's arguments in the impls' order (a bad one raises, as the call would; so
    does a destination that torch's in-place ops would refuse to write).
    None: explain was given only ``device``/``dtype``; for a dtype the op does not declare, its
    first parity case with default options stands for the call, its floating tensors in
    ``dtype``, and the error is returned (an int dtype on a floating-only op). Ops without a
    validator pass, as do the dtypes an op declares (its parity cases run in them).
    """
    import torch

    from .writes import writable

    if args is not None:  # the call refuses a write torch's in-place ops refuse, first (Op._dispatch_slow)
        writable(op.id, op._written, args)
    validate = op.validate or getattr(_module_of(op), "validate", None)
    if validate is None:
        return None
    if args is not None:
        validate(*args)
        return None
    wanted = dtype if dtype is not None else torch.float32
    if wanted in op.dtypes:
        return None
    case = _stand_in(op)
    if case is None:
        return None
    case, options = case
    stand_in = tuple(a.to(wanted) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in case)
    try:
        validate(*call_args(op, stand_in, options))
    except OpArgumentError as exc:
        return exc
    except Exception:  # a check that cannot take the stand-in: nothing to report
        return None
    return None


# Per op id: (the op, its stand-in arguments or None), built on the first explain that needs them.
_stand_ins: dict[str, tuple[Any, tuple[tuple[Any, ...], dict[str, Any]] | None]] = {}


def _stand_in(op: OpLike) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """Arguments and options of ``op``'s first parity case with default options (CPU, fp32), else
    of its first case (an op with no valid call without options: GRPO's beta needs reference
    log-probs), or None."""
    import torch

    hit = _stand_ins.get(op.id)
    if hit is not None and hit[0] is op:
        return hit[1]
    try:
        with torch.random.fork_rng(devices=[]):  # the caller's random stream is left as it was
            cases = op.cases("cpu", torch.float32)
            case = next((c for c in cases if not c.kwargs), cases[0] if cases else None)
        args = None if case is None else (tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in case.args), dict(case.kwargs))
    except Exception:  # cases that cannot be built here: no stand-in
        args = None
    _stand_ins[op.id] = (op, args)
    return args
