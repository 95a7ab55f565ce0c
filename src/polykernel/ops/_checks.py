"""Argument checks shared by the op modules. Each raises before any kernel launch and names
the op and the argument."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import OpArgumentError, OpTypeError

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


def positive_float(op: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise OpArgumentError(op, name, f"expected a positive number, got {value!r}")


def finite_float(op: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or value in (float("inf"), float("-inf")):
        raise OpArgumentError(op, name, f"expected a finite number, got {value!r}")


def choice(op: str, name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise OpArgumentError(op, name, f"expected one of {', '.join(map(repr, allowed))}, got {value!r}")


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    # requires_grad first: inference inputs then skip the is_grad_enabled() call (hot path).
    return any(t is not None and t.requires_grad for t in tensors) and torch.is_grad_enabled()
