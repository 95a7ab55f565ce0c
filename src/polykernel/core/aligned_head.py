"""An LM head with its class count padded to a multiple of 16 bytes, for the chunked loss drivers'
matmuls (the single-device ones in ``polykernel.backends``, and the vocabulary-parallel loss's
slice of the head in ``polykernel.distributed.vocab``: here, below both layers).

A vocabulary that is not a multiple of 8 (16-bit) classes, such as granite's 49155 or olmo3's
100278, leaves every matmul over the head with a dimension and a leading dimension off cuBLAS's
16-byte alignment: its Hopper kernels then give way to CUTLASS's 1- or 2-element-aligned ones,
about a quarter of a training step's time (profiles in
``benchmarks/results/h100-2026-12-06-twentyfirst/``, families-6; with the padding, the
twenty-second run's). ``torch.compile`` pads these
matmuls itself (Inductor's ``pad_mm``). With the head's rows zero-padded, the logits come out
``[n, Vp]`` with zero columns past V; a driver hands its loss ``logits[:, :V]`` (a view: unit
column stride, row stride Vp), clears the columns past V in the gradient it writes there, and
runs the gradient matmuls over all Vp columns, which add exact zeros.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ALIGN_BYTES = 16


def padded_classes(v: int, element_size: int) -> int:
    """``v`` rounded up to a multiple of 16 bytes of ``element_size``-byte elements."""
    per = max(1, ALIGN_BYTES // element_size)
    return v + (-v % per)


def aligned_head(weight: torch.Tensor, bias: torch.Tensor | None, element_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(weight, bias)`` as they are when V is aligned, else copies zero-padded to
    :func:`padded_classes` rows (one ``[Vp, H]`` copy a call: ~0.1 ms for 49155 x 2048 bf16).

    >>> w, _ = aligned_head(torch.ones(5, 3, dtype=torch.bfloat16), None, 2)
    >>> tuple(w.shape), float(w[5:].abs().sum())
    ((8, 3), 0.0)
    """
    v = weight.shape[0]
    pad = padded_classes(v, element_size) - v
    if pad == 0:
        return weight, bias
    return F.pad(weight, (0, 0, 0, pad)), None if bias is None else F.pad(bias, (0, pad))


def own_rows(grad: torch.Tensor | None, v: int) -> torch.Tensor | None:
    """The first ``v`` rows of a padded ``[Vp, H]`` gradient buffer as a tensor of its own, not a
    view: ``grad`` itself, shrunk in place (its storage kept, nothing copied).

    A tied head (the embedding's weight as the LM head) gets two gradients in one backward, which
    autograd sums in place into the first only when that tensor is its own; a view (even
    ``grad[:Vp]``) made it sum into a third ``[V, H]`` tensor, one head more at the peak
    (benchmarks/results/h100-2026-12-07-thirtieth/trl-memory/; tests/ops/test_tied_head_grads.py).

    >>> g = torch.ones(8, 3)
    >>> r = own_rows(g, 5)
    >>> r is g, tuple(r.shape), r._is_view()
    (True, (5, 3), False)
    """
    if grad is not None and grad.shape[0] != v:
        grad.resize_(v, *grad.shape[1:])
    return grad
