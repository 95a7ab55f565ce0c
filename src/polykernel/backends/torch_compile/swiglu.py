"""torch.compile'd swiglu: the op's reference (``ops/swiglu.py``) through Inductor, with autograd."""

from __future__ import annotations

from ...ops.swiglu import OP_ID, reference
from ._compiled import impl

swiglu = impl(OP_ID, reference)  # (gate, up), as every swiglu impl
