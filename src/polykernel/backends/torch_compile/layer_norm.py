"""torch.compile'd layer_norm: the op's reference (``ops/layer_norm.py``) through Inductor, with autograd."""

from __future__ import annotations

from ...ops.layer_norm import OP_ID, reference
from ._compiled import impl

layer_norm = impl(OP_ID, reference)  # (x, weight, bias, eps), as every layer_norm impl
