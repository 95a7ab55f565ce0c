"""torch.compile'd fused_add_rms_norm: the op's reference (``ops/fused_add_rms_norm.py``) through Inductor, with autograd."""

from __future__ import annotations

from ...ops.fused_add_rms_norm import OP_ID, reference
from ._compiled import impl

fused_add_rms_norm = impl(OP_ID, reference)  # (x, residual, weight, eps, offset), as every fused_add_rms_norm impl
