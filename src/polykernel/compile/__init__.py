"""``torch.compile`` support: every op as ``torch.library`` custom ops (:mod:`.library`) and
their DTensor sharding rules (:mod:`.sharding`). Imported on the first compiled call only, so
eager use never loads ``torch.library`` machinery."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def custom_op_for(op: Any) -> Callable[..., Any]:
    """``callable(impl, *args)`` running ``op`` through its custom op (see :mod:`.library`)."""
    from . import library

    return library.custom_op_for(op)
