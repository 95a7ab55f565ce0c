"""torch.compile'd geglu: the op's reference (``ops/geglu.py``) through Inductor, with autograd."""

from __future__ import annotations

from ...ops.geglu import OP_ID, reference
from ._compiled import impl

geglu = impl(OP_ID, reference)  # (gate, up, approximate), as every geglu impl
