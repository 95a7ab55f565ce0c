"""``activation.sparsemax``: the Euclidean projection of ``x`` onto the simplex along ``dim``.

``y = max(x - τ, 0)`` with the row's threshold τ chosen so that ``Σ y = 1`` (Martins & Astudillo,
2016): a softmax whose output has exact zeros. Math in fp32 (fp64 stays fp64), output in x's
dtype. ``-inf`` logits get 0; a row with no finite maximum (all ``-inf``) or holding a NaN or
``+inf`` gives NaN at every position (as softmax would), and a zero gradient. Backward, with S
the support ``{y > 0}``: ``dx = dy - mean_S(dy)`` on S, 0 elsewhere.

The threshold is shift-invariant, so it is computed on ``x - max(x)``: only logits within 1 of
the row's maximum can be in the support, and there that subtraction is exact (Sterbenz), so the
result's error does not grow with the logits' magnitude (logits of 1e4 keep fp32 accuracy).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..core.hit_guard import SHAPE
from ..core.op import Bounds, Case, ErrorModel, Op
from . import _checks as check

OP_ID = "activation.sparsemax"


def threshold(zc: torch.Tensor) -> torch.Tensor:
    """τ of each row of ``zc`` ``[..., n]`` (n >= 1) whose maximum is 0: ``Σ relu(zc - τ) = 1``,
    as ``[..., 1]``. Sort-based: the support is the k largest, k the last j (1-based) with
    ``1 + j·z_(j) > Σ_{i<=j} z_(i)``; then ``τ = (Σ_{i<=k} z_(i) - 1) / k``."""
    srt = zc.sort(-1, descending=True).values
    j = torch.arange(1, zc.shape[-1] + 1, device=zc.device, dtype=zc.dtype)
    s = srt.detach()
    in_support = 1 + j * s > s.cumsum(-1)
    k = in_support.sum(-1, keepdim=True).clamp_min(1)  # >= 1 on finite rows; 1 keeps bad rows' grads 0
    return (torch.where(in_support, srt, 0.0).sum(-1, keepdim=True) - 1) / k


def reference(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The semantics, in plain torch (fp32 math; fp64 stays fp64)."""
    acc = torch.promote_types(x.dtype, torch.float32)
    z = x.to(acc).movedim(dim, -1)
    if z.shape[-1] == 0:
        return x.clone()
    m = z.amax(-1, keepdim=True).detach()  # a shift: τ moves with it, y does not
    zc = z - m
    y = F.relu(zc - threshold(zc))
    y = torch.where(torch.isfinite(m), y, float("nan"))  # all -inf, +inf or NaN in the row
    return y.movedim(-1, dim).to(x.dtype)


def validate(x: torch.Tensor, dim: int) -> None:
    check.tensor(OP_ID, "x", x)
    check.floating(OP_ID, "x", x)
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise check.OpTypeError(OP_ID, "dim", f"expected an int, got {type(dim).__name__}")
    if not -x.dim() <= dim < x.dim():
        raise check.OpArgumentError(OP_ID, "dim", f"{dim} is out of range for a {x.dim()}-d x (expected {-x.dim()} .. {x.dim() - 1})")


def _key(x: torch.Tensor, dim: int = -1) -> tuple:
    """The argument class: with it `validate` runs once per class (on the memo miss). n (the
    length along dim) is in it because an impl's eligibility depends on it (Liger: N <= 65536);
    the guard holds x's whole shape, so a call along another dim never reuses this decision."""
    return (x.device, x.dtype, check.needs_grad(x), x.shape[dim], x.dim(), dim)


_op: Op  # defined below, after the public function it serves (with _dispatch, its dispatch)


def sparsemax(x: torch.Tensor, dim: int = -1, *, impl: str | None = None) -> torch.Tensor:
    """Sparsemax of ``x`` along ``dim``: a probability vector per row, with exact zeros.

    >>> import torch, polykernel
    >>> polykernel.sparsemax(torch.tensor([[1.0, 0.8, -1.0], [0.0, 0.0, 0.0]]))
    tensor([[0.6000, 0.4000, 0.0000],
            [0.3333, 0.3333, 0.3333]])
    >>> y = polykernel.sparsemax(torch.randn(4, 8), dim=0, impl="torch")  # along dim 0, forced impl
    """
    return _dispatch(impl, x, dim)  # _op.dispatch; the class and validation: see _key


# -- error model (see polykernel.core.op.ErrorModel) --------------------------------------------------
# On z = x - max the support's values lie in (-1, 0] and are exact (Sterbenz; within 2·u32 when
# |max| < 2), so τ = (Σ_S z - 1)/k is off by ~λ·√k·u32 (a sum of k terms of size <= 1, divided by
# k) and y = z - τ (<= 1) by that much absolutely, whatever the logits' scale: scale 1. Backward
# dx = dy - mean_S(dy) (|dy| <= 1): the mean of k terms, absolutely. Both then round once to x's
# dtype. A logit within rounding of τ may fall on either side of the support (y ≈ 0 either way:
# the forward is continuous, the gradient is not); the parity cases avoid such exact boundaries
# except where they are exact in every precision (dyadic ties).
def error_model(x: torch.Tensor, dim: int = -1) -> Bounds:
    n = x.shape[dim] if x.dim() else 1
    y = ErrorModel(ops=2, cancel=4, sum_abs=1, n=n, scale=1.0)
    dx = ErrorModel(ops=2, cancel=4, sum_abs=1, n=n, scale=2.0)
    return Bounds(outputs=(y,), grads={0: dx})


def example(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str, requires_grad: bool = False) -> Case:
    """Random logits of one shape (benchmarks, ``explain --shape``, the demo)."""
    return Case(f"{'x'.join(map(str, shape))}", (torch.randn(shape, dtype=dtype, device=device, requires_grad=requires_grad),))


def bytes_moved(x: torch.Tensor, *_: object, backward: bool = False) -> int:
    """Fewest bytes: forward reads x and writes y (2·numel·size); the backward reads x, dy and
    writes dx (the support is recomputed from x and two fp32 numbers per row), so
    forward+backward is 5·numel·size."""
    return (5 if backward else 2) * x.numel() * x.element_size()


LONG_N = 20000  # > the Triton one-block limit (16384): the chunked path
MID_N = 9000  # Triton: one block, one row per program


def cases(device: torch.device | str, dtype: torch.dtype, large: bool = False) -> list[Case]:
    """Awkward shapes, ties, big and infinite logits, long rows, other dims; sized for the CPU
    interpreter unless ``large``."""

    def t(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(shape, device=device)).to(dtype).requires_grad_()

    def rows(*values: list[float]) -> torch.Tensor:
        return torch.tensor(values, device=device).to(dtype).requires_grad_()

    def masked(m: int, n: int, start: int, stop: int) -> torch.Tensor:
        x = 3 * torch.randn(m, n, device=device)
        x[:, start:stop] = float("-inf")
        return x.to(dtype).requires_grad_()

    inf, nan = float("inf"), float("nan")
    out = [
        Case("1x1", (t(1, 1),)),
        Case("7", (t(7),)),
        Case("3x7", (t(3, 7),)),
        Case("2x5x33", (t(2, 5, 33),)),
        Case("0x16", (t(0, 16),)),
        Case("5x0", (t(5, 0),)),
        # dyadic values: exact in every dtype, so the support (and the gradient) is too
        Case(
            "ties",
            (
                rows(
                    [1.0, 1.0, 0.0, 0.0, -1.0, 0.5],  # 0.5 sits exactly at τ: outside the support
                    [0.5] * 6,  # all equal: 1/n each
                    [2.0, 2.0, 2.0, 1.0, 1.0, 1.0],
                    [1.0, 0.0, -3.0, -3.0, 0.0, -0.5],  # τ = 0: the zeros sit exactly at it
                    [8.0, 8.0, -8.0, 8.0, 7.5, 7.25],
                ),
            ),
        ),
        Case("3x64-all-equal", (torch.full((3, 64), -2.5, device=device).to(dtype).requires_grad_(),)),
        Case("4x1000-logits-1e4", (t(4, 1000, scale=1e4),)),
        Case("6x2048-masked", (masked(6, 2048, 0, 1500),)),
        Case(
            "nonfinite-rows", (rows([0.0, -inf, 1.0, 2.0], [-inf] * 4, [1.0, inf, 0.0, 0.0], [nan, 1.0, 0.0, 0.5], [3.0, -inf, -inf, 3.0]),)
        ),
        Case("9x200-rowstrided", (t(18, 200)[::2],)),
        Case("7x64-colstrided", (t(7, 128)[:, ::2],)),
        Case("3x12x5-dim1", (t(3, 12, 5, scale=2.0),), {"dim": 1}),
        Case("40x6-dim0", (t(40, 6),), {"dim": 0}),
        Case(f"5x{MID_N}-mid", (t(5, MID_N, scale=3.0),)),
        Case(f"2x{LONG_N}-long", (t(2, LONG_N, scale=4.0),)),
        Case(f"2x{LONG_N}-long-masked", (masked(2, LONG_N, 0, 10000),)),  # whole chunks of -inf
    ]
    if large:
        out += [
            Case("16384x4096", (t(16384, 4096),)),
            Case("4096x32768", (t(4096, 32768, scale=3.0),)),
            Case("8x8192x64-dim1", (t(8, 8192, 64),), {"dim": 1}),
            Case("1031x50257-odd", (t(1031, 50257),)),
            Case("512x32768-logits-1e4", (t(512, 32768, scale=1e4),)),
            Case("64x262144-long", (t(64, 262144, scale=4.0),)),
        ]
    return out


def outputs(x: torch.Tensor, *_: object) -> tuple[tuple[torch.Size, torch.dtype], ...]:
    """The reference's output shape and dtype, without running it (the first-call check)."""
    return ((x.shape, x.dtype),)


_op = Op(
    OP_ID,
    fields=("device", "dtype", "needs_grad", "n", "ndim", "dim"),
    key=_key,
    guard=(SHAPE, None),
    default_key=lambda device, dtype: (device, dtype, False, None, None, -1),
    validate=validate,
    reference=reference,
    outputs=outputs,
    error_model=error_model,
    dtypes=(torch.float32, torch.bfloat16, torch.float16),
    cases=cases,
    example=example,
    bytes_moved=bytes_moved,
    # impls: none here, each backend registers its own (its manifest.py: polykernel.backends)
    # no DTensor layout: the dim it reduces over is an argument (DTensor's rules on the torch impl)
)
_dispatch = _op.dispatch  # bound once: ~30 ns less per call than the attribute lookup
