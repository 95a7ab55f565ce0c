"""The per-token log-prob primitive of the fused preference/RL losses, in torch.

Two functions on one chunk of fp32 logits ``z [n, V]`` (bias and temperature already applied)
and its targets ``t [n]``:

- ``token_logps(z, t, ignore_index) -> (logp, lse)``: ``z[t] - logsumexp(z)`` per row (0 where
  ``t == ignore_index``) and the row's LSE, both fp32 ``[n]``.
- ``token_grad_(z, t, lse, scale, out, ignore_index)``: ``out = scale · (softmax(z) − onehot(t))``
  per row (cross-entropy's sign convention, so the Triton impl can reuse the cross-entropy
  kernel), 0 on ignored rows; ``out`` may be ``z`` itself, and ``z`` is overwritten either way.

The Triton twin (``polykernel.backends.triton._token_logps``) has the same two functions.
"""

from __future__ import annotations

import torch

from ._cross_entropy import scale_grads_  # noqa: F401  (the backward's cotangent multiply, for the driver)


def token_logps(z: torch.Tensor, t: torch.Tensor, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    valid = t != ignore_index
    lse = torch.logsumexp(z, -1)
    zt = z.gather(1, torch.where(valid, t, 0)[:, None]).squeeze(1)
    return torch.where(valid, zt - lse, 0.0), lse


def token_grad_(z: torch.Tensor, t: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, ignore_index: int) -> None:
    valid = t != ignore_index
    z.sub_(lse[:, None]).exp_()  # softmax, in place (no second [n, V] buffer)
    z.scatter_add_(1, torch.where(valid, t, 0)[:, None], -valid.to(z.dtype)[:, None])
    # masked, not multiplied by 0: an ignored row's gradient is 0 even when its scale, or its
    # softmax (a NaN or inf hidden state), is inf or NaN
    z.mul_(scale.to(z.dtype)[:, None]).masked_fill_(~valid[:, None], 0.0)
    if out is not z:
        out.copy_(z)
