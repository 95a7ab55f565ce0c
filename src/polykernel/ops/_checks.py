"""Argument checks shared by the op modules. Each raises before any kernel launch and names
the op and the argument."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..errors import OpArgumentError, OpTypeError, shown

FLOATING = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def tensor(op: str, name: str, value: Any, *, min_dim: int = 1) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise OpTypeError(op, name, f"expected a torch.Tensor, got {type(value).__name__}")
    if value.dim() < min_dim:
        raise OpArgumentError(op, name, f"expected at least {min_dim} dimension(s), got shape {tuple(value.shape)}")
    return value


def floating(op: str, name: str, value: torch.Tensor) -> None:
    if value.dtype not in FLOATING:
        raise OpTypeError(op, name, f"expected a floating tensor (float32, bfloat16, float16, float64), got {value.dtype}")


def same_device(op: str, name: str, value: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if value.device != ref.device:
        raise OpArgumentError(op, name, f"is on {value.device} but {ref_name!r} is on {ref.device}")


INT64 = (-(2**63), 2**63 - 1)


def _float(value: Any) -> float | None:
    """``value`` as a float; None for a bool, a non-number, or an int outside int64, which
    torch's scalars (the reference's ``x + eps``) and Triton's integer arguments cannot take
    (``10**30``: OverflowError at the launch otherwise)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, int) and not INT64[0] <= value <= INT64[1]:
        return None
    return float(value)


def _got(value: Any) -> str:
    too_large = isinstance(value, int) and not isinstance(value, bool) and _float(value) is None
    return f"got {shown(value)}" + (" (an int outside int64's range; pass a float)" if too_large else "")


def positive_float(op: str, name: str, value: Any) -> None:
    v = _float(value)
    if v is None or not v > 0:
        raise OpArgumentError(op, name, f"expected a positive number, {_got(value)}")


def nonnegative_float(op: str, name: str, value: Any) -> None:
    v = _float(value)
    if v is None or not v >= 0:
        raise OpArgumentError(op, name, f"expected a number >= 0, {_got(value)}")


def is_finite(v: float) -> bool:
    """``math.isfinite(v)``, also for a symbolic float, which Dynamo cannot pass to ``math``
    (``torch.compile(dynamic=True)`` traces modules' float attributes so): ``inf - inf`` and
    ``nan - nan`` are NaN, never 0. Validation traced under compile checks finiteness with this."""
    return v - v == 0


def finite_float(op: str, name: str, value: Any) -> None:
    v = _float(value)
    if v is None or not is_finite(v):
        raise OpArgumentError(op, name, f"expected a finite number, {_got(value)}")


def eps(op: str, value: Any, name: str = "eps") -> None:
    """A normalisation's ``eps``: a finite number >= 0 (``inf`` would scale every row to 0, NaN
    poison it: silently wrong outputs, never an error)."""
    v = _float(value)
    if v is None or not 0 <= v < math.inf:
        raise OpArgumentError(op, name, f"expected a finite number >= 0, {_got(value)}")


def int64(op: str, name: str, value: Any) -> None:
    """An int (not a bool) that fits int64: tensors compare with it, kernels take it as i64."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise OpTypeError(op, name, f"expected an int, got {shown(value)}")
    if not INT64[0] <= value <= INT64[1]:
        raise OpArgumentError(op, name, f"expected an int in int64's range [-2**63, 2**63 - 1], got {shown(value)}")


def ignore_index(op: str, value: Any, labels_name: str, labels: Any) -> None:
    """``ignore_index``: an int64 (as torch's ``F.cross_entropy`` takes) that fits ``labels``'
    integer dtype, for every op that takes one. torch compares an integer tensor with a Python int
    in the tensor's dtype, wrapping (int32 labels equal ``2**32 + 5`` where they hold 5, uint8
    ones ``-100`` where they hold 156), and kernels may compare in either width: a value outside
    the dtype could never match a label yet would drop rows. ``labels`` not an integer tensor
    (None, or a bad one ``validate`` names itself): the int64 check only."""
    int64(op, "ignore_index", value)
    if not isinstance(labels, torch.Tensor) or labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        return
    info = torch.iinfo(labels.dtype)
    if not info.min <= value <= info.max:
        raise OpArgumentError(
            op,
            "ignore_index",
            f"{value} is outside the range [{info.min}, {info.max}] of the dtype of {labels_name} ({labels.dtype}), so it could never "
            f"match a label (and would wrap in the comparison); pass a value in that range, or {labels_name} as int64",
        )


def boolean(op: str, name: str, value: Any) -> None:
    """A bool option: exactly True or False (a string such as ``"False"`` or an int is truthy
    or falsy by accident). The core checks every option annotated ``bool`` (or defaulting to one)
    the same way before the memo; ops that validate before dispatch call this."""
    if value is not True and value is not False:
        raise OpTypeError(op, name, f"expected a bool, got {shown(value)} ({type(value).__name__})")


def choice(op: str, name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise OpArgumentError(op, name, f"expected one of {', '.join(map(repr, allowed))}, got {shown(value)}")


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    # requires_grad first: inference inputs then skip the is_grad_enabled() call (hot path).
    return any(t is not None and t.requires_grad for t in tensors) and torch.is_grad_enabled()
