"""torch.compile'd rms_norm: the op's reference (``ops/rms_norm.py``) through Inductor, with autograd."""

from __future__ import annotations

from ...ops.rms_norm import OP_ID, reference
from ._compiled import impl

rms_norm = impl(OP_ID, reference)  # (x, weight, eps, offset, casting), as every rms_norm impl
