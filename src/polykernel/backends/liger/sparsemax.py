"""Liger-Kernel sparsemax (``LigerSparsemaxFunction``) on ``activation.sparsemax``'s signature.

Liger sorts each row with ``torch.sort`` (an fp32 copy of x), then one block per row finds τ
(the predicate refuses N > 65536); its backward takes the support from the saved y. Liger
computes something for rows without a finite maximum (all ``-inf``: zeros; ``+inf``: no
probability vector at all), where the contract gives NaN: the adapter masks those rows with
NaN, which also zeroes their gradient as the contract's (one max and one masked copy: two
passes over x that Liger alone would not make).
"""

from __future__ import annotations

import torch
from liger_kernel.ops.sparsemax import LigerSparsemaxFunction

from .._double_backward import refusing
from .._fallback import registered

# what this impl does not take goes to the torch impl, resolved by name on first use (polykernel.backends._fallback)
_torch_sparsemax = registered("activation.sparsemax")

# create_graph=True: second derivatives raise, naming the op, instead of reading zeros (refusing();
# Liger keeps y, not x: x is held by an empty anchor)
_Sparsemax = refusing(LigerSparsemaxFunction, "activation.sparsemax", "liger", (0,), kept=False)


def sparsemax(x: torch.Tensor, dim: int) -> torch.Tensor:
    if x.numel() == 0:  # Liger's view(n_rows, n_cols) of an empty x
        return _torch_sparsemax(x, dim)
    bad = ~torch.isfinite(x.detach().amax(dim, keepdim=True))  # all -inf, +inf or NaN in the row
    return _Sparsemax.apply(x, dim).masked_fill(bad, float("nan"))
