"""An op's error model: how far an impl's outputs and gradients may be from the exact result.

Shared by the parity harness (:mod:`polykernel.testing`), tuning's parity check and first-use
verification (:mod:`polykernel.core.verify`), and the op files, which state their model with
:class:`ErrorModel`/:class:`Bounds`. ``polykernel.core.op`` re-exports these names.

    >>> import torch
    >>> ErrorModel(ops=4, sum_rel=1, n=4096).tol(torch.bfloat16, scale=1.0).rtol < 2**-7
    True
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["SUM_LAMBDA", "TINY", "UNIT_ROUNDOFF", "Bounds", "ErrorModel", "Tol", "compute_dtype"]


@dataclass(frozen=True)
class Tol:
    """``|out - ref| <= atol + rtol * |ref|`` elementwise (``torch.testing.assert_close``)."""

    atol: float
    rtol: float


# Unit roundoff u (half an ulp at 1) of each dtype: a correctly rounded result is within u·|exact|.
UNIT_ROUNDOFF: dict[torch.dtype, float] = {
    torch.float64: 2.0**-53,
    torch.float32: 2.0**-24,
    torch.bfloat16: 2.0**-8,
    torch.float16: 2.0**-11,
    # fp8 e4m3 (the serving quantisation ops' output): 3 mantissa bits. Its values are computed
    # in fp32 like bf16/fp16 ones (see compute_dtype: torch refuses to promote fp8 types).
    torch.float8_e4m3fn: 2.0**-4,
}
# Half the smallest subnormal: the absolute floor of one rounding to the dtype.
TINY: dict[torch.dtype, float] = {
    torch.float64: 2.0**-1075,
    torch.float32: 2.0**-150,
    torch.bfloat16: 2.0**-134,
    torch.float16: 2.0**-25,
    torch.float8_e4m3fn: 2.0**-10,  # smallest subnormal 2^-9
}


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype an output of ``dtype`` is computed in: fp64 for fp64, else fp32 (the contract's
    fp32 math). ``torch.promote_types(dtype, float32)`` for every dtype it accepts; it refuses fp8."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# A sum of n terms rounded in any order (sequential, pairwise, blocked, tree, split across
# programs) is within about λ·√n·u of the exact sum, relative to the magnitude of what is summed,
# except with probability ≤ 2·exp(-λ²/2) per sum (Higham & Mary, "A new approach to probabilistic
# rounding error analysis", SISC 2019). λ = 6: ~3e-8 per sum. The worst case, n·u, would be
# 1.6% at n = 256K in fp32: too loose to catch a kernel that drops a block of a row.
SUM_LAMBDA = 6.0


@dataclass(frozen=True)
class ErrorModel:
    """How far one output (or gradient) may be from the exact result, in units of roundoff.

    For a tensor of dtype ``d`` computed in ``c`` = fp32 (fp64 for fp64 inputs), whose longest
    sum has ``n`` terms, against the exact (float64) result::

        |out - exact| <= rel·|exact| + abs·scale      (scale: max |exact| over the tensor,
        rel = rounds·u(d) + (ops + λ·√n·sum_rel)·u(c)  unless the op's model gives one)
        abs = rounds_abs·u(inter) + (cancel + λ·√n·sum_abs)·u(c)

    - ``rounds``: roundings to ``d`` on the way (1: the result; 2 when the semantics round an
      intermediate too, e.g. ``casting="llama"``);
    - ``ops``: roundings of the elementwise math in ``c`` (an approximate exp or rsqrt ~2 each);
    - ``sum_rel``: sums whose error stays relative to each element (sums of positive terms: the
      norms' mean of squares, softmax's sum of exps);
    - ``cancel``, ``sum_abs``: errors relative to the magnitude of what is combined rather than to
      each element, where terms cancel (dW = Σ dy·x̂ over rows, dx's mean(g·x̂), p - onehot);
    - ``rounds_abs``: roundings of an intermediate whose error reaches the result through such a
      combination (fused_add_rms_norm's rounded sum, the linear cross-entropy's logits), in
      units of ``u(inter)``: the intermediate's dtype, ``d`` unless given.

    Each rounding (``rounds``, ``rounds_abs``) is also off by up to half the smallest subnormal of
    its dtype in absolute terms (fp16 x̂ below 6e-5, say); ``floor`` adds what the op's model
    derives from that where such errors are summed (tiny fp16 logit gradients over many rows).

    ``nonfinite_rows``: a row that holds a non-finite input may come back NaN at every position
    (row statistics computed in one pass, e.g. Welford's, turn ``inf`` into ``inf - inf``), where
    the exact result is NaN only where the input was. PyTorch's own CUDA RMSNorm and LayerNorm do
    this, so the contract allows it for the norms; every other position must still match.
    """

    rounds: float = 1.0
    ops: float = 4.0
    sum_rel: float = 0.0
    cancel: float = 0.0
    sum_abs: float = 0.0
    rounds_abs: float = 0.0
    n: int = 1
    scale: float | None = None
    inter: torch.dtype | None = None
    floor: float = 0.0
    nonfinite_rows: bool = False

    def tol(self, dtype: torch.dtype, scale: float, rounding: float = 1.0) -> Tol:
        """Tolerance for one tensor of ``dtype``; ``scale`` = max |exact| unless the model has
        its own. ``rounding`` = 2 where conversions to ``dtype`` truncate instead of rounding
        to nearest (Triton's CPU interpreter does this for bf16): one ulp instead of half."""
        u_d = UNIT_ROUNDOFF[dtype] * rounding
        u_i = UNIT_ROUNDOFF[self.inter or dtype] * rounding
        u_c = UNIT_ROUNDOFF[compute_dtype(dtype)]
        growth = SUM_LAMBDA * max(self.n, 1) ** 0.5
        rel = self.rounds * u_d + (self.ops + growth * self.sum_rel) * u_c
        abs_ = self.rounds_abs * u_i + (self.cancel + growth * self.sum_abs) * u_c
        tiny = (max(self.rounds, 1.0) * TINY[dtype] + self.rounds_abs * TINY[self.inter or dtype]) * rounding
        return Tol(atol=abs_ * (scale if self.scale is None else self.scale) + tiny + self.floor, rtol=rel)


@dataclass(frozen=True)
class Bounds:
    """An op's error model for one call: one :class:`ErrorModel` per output (the last one
    repeats) and one per positional argument that takes a gradient."""

    outputs: tuple[ErrorModel, ...]
    grads: dict[int, ErrorModel] = field(default_factory=dict)

    def output(self, i: int) -> ErrorModel:
        return self.outputs[min(i, len(self.outputs) - 1)]
