"""torch.compile'd rope: the op's reference (``ops/rope.py``) through Inductor, with autograd."""

from __future__ import annotations

from ...ops.rope import OP_ID, reference
from ._compiled import impl

rope = impl(OP_ID, reference)  # (q, k, cos, sin), as every rope impl
