"""Shared by the QuACK adapters: QuACK's kernels take 2-D row-major tensors at 16-byte aligned
addresses.

QuACK compiles each kernel for a layout it assumes rather than checks: ``quack/rmsnorm.py``
(``_compile_rmsnorm_fwd``) and ``quack/cross_entropy.py`` build their fake tensors with
``quack/compile_utils.py`` ``make_fake_tensor``, whose ``assumed_align`` is ``gcd(N, 16 bytes /
element)`` elements: 16 bytes for every N the gates admit. A contiguous view at an odd offset (a
flat buffer's ``[1:]`` reshaped) is contiguous yet not 16-byte aligned; its 128-bit loads would read
misaligned addresses, so such a tensor is handed over as an aligned copy.
"""

from __future__ import annotations

import torch

from .._dense import readable


def rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t`` as contiguous, 16-byte aligned ``[rows, n]`` (a view when it already is one, else a copy)."""
    return readable(t.reshape(-1, n))
