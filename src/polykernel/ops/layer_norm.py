"""``norm.layer_norm``: ``(x - mean(x)) / sqrt(var(x) + eps) * weight + bias`` over the last dim.

``weight`` and ``bias`` are optional, each on its own (``None`` means 1 and 0). The statistics
and the affine step are computed in fp32 (fp64 stays fp64) and cast once to ``x.dtype``; the
weight and bias may have another floating dtype than ``x`` (fp32 parameters with bf16
activations), and their gradients come back in their own dtypes. ``var`` is the biased variance
(divide by N), as in ``torch.nn.functional.layer_norm``.
"""

from __future__ import annotations

import torch

from ..core.hit_guard import LAST, SHAPE
from ..core.op import SUM_LAMBDA, Bounds, Case, ErrorModel, Op, rows_and_len
from ..distributed.layout import ROWS, Layout, rows_with
from . import _checks as check

OP_ID = "norm.layer_norm"


def reference(x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    """The semantics, in plain torch (fp32 math; fp64 stays fp64)."""
    acc = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(acc)
    xc = xf - xf.mean(-1, keepdim=True)
    y = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(acc)
    if bias is not None:
        y = y + bias.to(acc)
    return y.to(x.dtype)


def _param(x: torch.Tensor, name: str, p: torch.Tensor | None) -> None:
    if p is None:
        return
    check.tensor(OP_ID, name, p)
    check.floating(OP_ID, name, p)
    if p.dim() != 1 or p.shape[0] != x.shape[-1]:
        raise check.OpArgumentError(OP_ID, name, f"expected shape ({x.shape[-1]},) to match x's last dim, got {tuple(p.shape)}")
    check.same_device(OP_ID, name, p, "x", x)


def validate(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float) -> None:
    check.tensor(OP_ID, "x", x)
    check.floating(OP_ID, "x", x)
    _param(x, "weight", weight)
    _param(x, "bias", bias)
    check.eps(OP_ID, eps)


_grad_enabled = torch.is_grad_enabled


def _param_class(p: torch.Tensor | None) -> tuple | None:
    return None if p is None else (p.dtype, p.shape, p.device)


def _key(x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None, eps: float = 1e-5) -> tuple:
    """The argument class. It holds everything validity depends on, so `validate` runs once per
    class (on the memo miss), not per call. The guard (``_op``'s ``guard``) recognises a repeat
    of it without building it: x's last dim and the parameters' whole shapes (or None)."""
    needs_grad = (
        x.requires_grad or (weight is not None and weight.requires_grad) or (bias is not None and bias.requires_grad)
    ) and _grad_enabled()
    return (
        x.device,
        x.dtype,
        needs_grad,
        x.shape[-1],
        None if weight is None else weight.dtype,
        None if bias is None else bias.dtype,
        _param_class(weight),
        _param_class(bias),
        eps,
    )


_op: Op  # defined below, after the public function it serves (with _dispatch, its dispatch)


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    impl: str | None = None,
) -> torch.Tensor:
    """Layer-normalize ``x`` over its last dim, then scale by ``weight`` and shift by ``bias``.

    >>> import torch, polykernel
    >>> x, w, b = torch.randn(4, 8), torch.ones(8), torch.zeros(8)
    >>> polykernel.layer_norm(x, w, b).shape
    torch.Size([4, 8])
    >>> y = polykernel.layer_norm(x, impl="torch")  # no affine parameters, forced impl
    """
    return _dispatch(impl, x, weight, bias, eps)  # _op.dispatch; the class and validation: see _key


# -- error model (see polykernel.core.op.ErrorModel) --------------------------------------------------
# y = (x - μ)·rstd·w + b in fp32, rounded once. μ sums N terms of size up to max|x|, so x̂ is off by
# up to (λ·√N + 2)·u32·k, where k = max |x|·rstd: the data's offset in units of its spread (~4 for
# centred rows, ~45 for the "shifted" cases, whose one-pass E[x²] - E[x]² variance would be off by
# 1e-4 and is caught); the variance is a positive sum (relative). dx = rstd·(g - mean(g) -
# x̂·mean(g·x̂)) cancels: relative to the magnitude of its terms rstd·max|w|·k. dW = Σ dy·x̂ and
# dB = Σ dy over M rows, random signs: relative to √M·k, with x̂'s error above in every term.
def error_model(x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None, eps: float = 1e-5) -> Bounds:
    rows, n = rows_and_len(x)
    k = rstd_max = 0.0
    if x.numel():
        xd = x.detach().double()
        rstd = torch.rsqrt(xd.var(-1, unbiased=False, keepdim=True) + eps)
        k, rstd_max = max(1.0, (xd.abs() * rstd).max().item()), rstd.max().item()
    w_max = weight.detach().abs().max().item() if weight is not None and weight.numel() else 1.0
    y = ErrorModel(ops=6, sum_rel=0.5, cancel=2 * k, sum_abs=k, n=n, scale=k * w_max, nonfinite_rows=True)
    dx = ErrorModel(ops=4, sum_rel=0.5, cancel=8 + 2 * k, sum_abs=1 + k, n=n, scale=rstd_max * w_max * k)
    # dW, dB: M terms of size <= k (|dy| <= 1, |x̂| <= k): partial sums ~√M·k, each term off by x̂'s error
    dwb = ErrorModel(ops=4, cancel=2 * SUM_LAMBDA, sum_abs=1 + SUM_LAMBDA, n=max(n, rows), scale=max(rows, 1) ** 0.5 * k)
    return Bounds(outputs=(y,), grads={0: dx, 1: dwb, 2: dwb})


def example(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str, requires_grad: bool = False) -> Case:
    """Random arguments of a given x shape (benchmarks, ``explain --shape``, the demo)."""
    x = torch.randn(shape, dtype=dtype, device=device, requires_grad=requires_grad)
    w = (1 + 0.1 * torch.randn(shape[-1], device=device)).to(dtype).requires_grad_(requires_grad)
    b = (0.1 * torch.randn(shape[-1], device=device)).to(dtype).requires_grad_(requires_grad)
    return Case(f"{'x'.join(map(str, shape))}", (x, w, b))


def bytes_moved(
    x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None, *_: object, backward: bool = False
) -> int:
    """Fewest bytes: forward reads x and writes y; backward adds x, dy read and dx written."""
    n = x.numel() * x.element_size()
    params = sum(p.numel() * p.element_size() for p in (weight, bias) if p is not None)
    return (5 if backward else 2) * n + params * (3 if backward else 1)


def cases(device: torch.device | str, dtype: torch.dtype, large: bool = False) -> list[Case]:
    """Awkward shapes and every option, sized for the CPU interpreter unless ``large``."""

    def t(*shape: int, shift: float = 0.0) -> torch.Tensor:
        return (torch.randn(shape, device=device) + shift).to(dtype).requires_grad_()

    def w(n: int, pdtype: torch.dtype = dtype) -> torch.Tensor:
        return (1 + 0.1 * torch.randn(n, device=device)).to(pdtype).requires_grad_()

    def b(n: int, pdtype: torch.dtype = dtype) -> torch.Tensor:
        return (0.1 * torch.randn(n, device=device)).to(pdtype).requires_grad_()

    out = [
        Case("1x1", (t(1, 1), w(1), b(1))),
        Case("3x7", (t(3, 7), w(7), b(7))),
        Case("2x5x33", (t(2, 5, 33), w(33), b(33))),
        Case("0x16", (t(0, 16), w(16), b(16))),
        Case("2x3x0", (t(2, 3, 0), w(0), b(0))),
        Case("5x96-no-affine", (t(5, 96), None, None), {"eps": 1e-6}),
        Case("6x80-weight-only", (t(6, 80), w(80), None)),
        Case("7x48-bias-only", (t(7, 48), None, b(48))),
        Case("4x64-fp32-params", (t(4, 64), w(64, torch.float32), b(64, torch.float32))),
        Case("8x300-shifted", (t(8, 300, shift=40.0), w(300), b(300))),  # mean >> std: variance must not cancel
        Case("9x200-rowstrided", (t(18, 200)[::2], w(200), b(200))),
        Case("7x64-colstrided", (t(7, 128)[:, ::2], w(128)[::2], b(192)[::3])),
        Case("3x70001-long", (t(3, 70001), w(70001), b(70001))),
        Case("2x20000-long-shifted-no-w", (t(2, 20000, shift=40.0), None, b(20000))),
        # variance ~ eps: eps misplaced or scaled shows in bf16 too (elsewhere it is ~1e-5 of the
        # variance, below rounding); last, so the other cases keep their values
        Case("4x64-tiny", ((1e-3 * torch.randn(4, 64, device=device)).to(dtype).requires_grad_(), w(64), b(64))),
    ]
    if large:
        out += [
            Case("16384x4096", (t(16384, 4096), w(4096), b(4096))),
            Case("4096x16384", (t(4096, 16384), w(16384), b(16384))),
            Case("1031x5120-fp32-params", (t(1031, 5120), w(5120, torch.float32), b(5120, torch.float32))),
            Case("8191x768-no-affine", (t(8191, 768), None, None)),
            Case("64x262144", (t(64, 262144), w(262144), b(262144))),
        ]
    return out


def outputs(x: torch.Tensor, *_: object) -> tuple[tuple[torch.Size, torch.dtype], ...]:
    """The reference's output shape and dtype, without running it (the first-call check)."""
    return ((x.shape, x.dtype),)


_op = Op(
    OP_ID,
    fields=("device", "dtype", "needs_grad", "n", "weight_dtype", "bias_dtype", "weight", "bias", "eps"),
    key=_key,
    guard=(LAST, SHAPE, SHAPE, None),
    default_key=lambda device, dtype: (device, dtype, False, None, dtype, dtype, None, None, 1e-5),
    validate=validate,
    reference=reference,
    outputs=outputs,
    error_model=error_model,
    dtypes=(torch.float32, torch.bfloat16, torch.float16),
    cases=cases,
    example=example,
    bytes_moved=bytes_moved,
    # impls: none here, each backend registers its own (its manifest.py: polykernel.backends)
    # torch.compile: our custom ops, faster than Inductor's code fwd+bwd (the torch.compile rows of
    # benchmarks/results/h200-2026-11-30-graph.json); saves mean and rstd
    saved=("rows", "rows"),
    dtensor_layout=Layout(ROWS, rows_with(), (0,)),
)
_dispatch = _op.dispatch  # bound once: ~30 ns less per call than the attribute lookup
