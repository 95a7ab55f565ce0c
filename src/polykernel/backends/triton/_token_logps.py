"""The per-token log-prob primitive of the fused preference/RL losses, in Triton.

It is the cross-entropy kernel (``polykernel.backends.triton.cross_entropy``), not a new one: its
FWD pass gives each row's LSE and ``loss = lse − z[t]`` (so ``logp = −loss``), its GRAD pass
writes ``scale · (softmax(z) − onehot(t))`` per row in the output's dtype from the saved LSE, with
a per-row fp32 scale read on the device. Same two functions as the torch primitive
(``polykernel.backends._token_logps``); GEMMs stay torch's (cuBLAS).
"""

from __future__ import annotations

import torch

from . import cross_entropy as _ce
from ._scale import scale_grads_  # noqa: F401  (the backward's cotangent multiply, for the driver)


def token_logps(z: torch.Tensor, t: torch.Tensor, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    loss, lse = _ce.ce_forward(z, t, ignore_index, 0.0)
    return loss.neg_(), lse


def token_grad_(z: torch.Tensor, t: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, ignore_index: int) -> None:
    if z.shape[0]:
        # the GRAD pass alone, into ``out`` (the hidden states' dtype; may be z itself)
        _ce._launch(z, t, lse, lse, out, scale, ignore_index, 0.0, False, True)
