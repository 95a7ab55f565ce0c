"""Liger-Kernel GroupNorm (``LigerGroupNormFunction``) on ``norm.group_norm``'s signature (weight
and bias both given, in x's dtype: the predicate excludes the other cases). Liger views x as
``[N, G, L]`` (a contiguous copy when it is not) and accumulates dW, dB with atomics."""

from __future__ import annotations

import torch
from liger_kernel.ops.group_norm import LigerGroupNormFunction

from .._double_backward import refusing
from .._fallback import registered

# what this impl does not take goes to the torch impl, resolved by name on first use (polykernel.backends._fallback)
_torch_group_norm = registered("norm.group_norm")

# Its kernels (liger_kernel/ops/group_norm.py, _group_norm_forward / _group_norm_backward) step to a
# sample at tl.program_id(0) * X_row_stride: int32 times an int32 argument (Triton types an int that
# fits as i32), so past 2**31 elements the offset wraps (an illegal address, or another sample's
# rows). Such tensors go to the torch impl.
INT32_ELEMS = 1 << 31

# create_graph=True: second derivatives raise, naming the op, instead of reading zeros (refusing())
_GroupNorm = refusing(LigerGroupNormFunction, "norm.group_norm", "liger", (0, 1, 2))


def group_norm(x: torch.Tensor, num_groups: int, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    if x.numel() == 0 or x.numel() > INT32_ELEMS or weight is None or bias is None:  # (0: Liger's view(N, G, -1) of an empty x)
        return _torch_group_norm(x, num_groups, weight, bias, eps)
    return _GroupNorm.apply(x, weight, bias, x.shape[1], num_groups, eps)
