"""torch.compile'd silu_and_mul: the op's reference (``ops/silu_and_mul.py``) through Inductor,
which writes the result into ``out`` (the compiled graph keeps the caller's tensor)."""

from __future__ import annotations

import torch

from ...ops.silu_and_mul import OP_ID, reference
from ._compiled import impl

_run = impl(OP_ID, reference)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    _run(x, out)
    return out  # the caller's tensor itself, whatever the compiled graph hands back


silu_and_mul.compile_ms = _run.compile_ms  # type: ignore[attr-defined]
