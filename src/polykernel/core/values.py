"""The small value classes an op module declares with: :class:`Case` (a parity case),
:class:`ArgClass` (a read-only view of an argument class) and :func:`rows_and_len`.
``polykernel.core.op`` re-exports these names."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


def rows_and_len(x: torch.Tensor) -> tuple[int, int]:
    """(rows, n) of a tensor reduced over its last dim."""
    n = x.shape[-1] if x.dim() else 1
    return (x.numel() // n if n else 0), n


@dataclass(frozen=True)
class Case:
    """One parity case: positional args, keyword args and a label for test ids."""

    label: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)


class ArgClass:
    """Named, read-only view of an argument-class tuple, handed to spec predicates."""

    __slots__ = ("_fields", "_values")

    def __init__(self, fields: Sequence[str], values: Sequence[Any]) -> None:
        self._fields = tuple(fields)
        self._values = tuple(values)

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[self._fields.index(name)]
        except ValueError:
            raise AttributeError(name) from None

    def as_dict(self) -> dict[str, Any]:
        return dict(zip(self._fields, self._values))

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v}" for k, v in self.as_dict().items())
        return f"ArgClass({inner})"
