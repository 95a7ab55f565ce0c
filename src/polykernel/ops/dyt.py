"""``norm.dyt``: Dynamic Tanh, ``weight·tanh(alpha·x) + bias`` (Zhu et al., 2025: a drop-in for
LayerNorm without statistics).

``alpha`` is a learnable scalar: a 0-dim or 1-element (``[1]``) tensor. ``weight`` and ``bias``
(optional: None means 0) are per feature of x's last dim. Math in fp32 (fp64 stays fp64), cast
once to x's dtype; alpha, weight and bias may have other floating dtypes than x (fp32
parameters with bf16 activations), and their gradients come back in their own dtypes and
shapes. Backward, with ``t = tanh(alpha·x)`` and ``g = dy·weight·(1 - t²)``: ``dx = alpha·g``,
``dalpha = Σ g·x`` over every element, ``dweight = Σ_rows dy·t``, ``dbias = Σ_rows dy``.
"""

from __future__ import annotations

import torch

from ..core.hit_guard import LAST, SHAPE
from ..core.op import SUM_LAMBDA, Bounds, Case, ErrorModel, Op, rows_and_len
from ..distributed.layout import ROWS, Layout, rows_with
from . import _checks as check

OP_ID = "norm.dyt"


def reference(x: torch.Tensor, alpha: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The semantics, in plain torch (fp32 math; fp64 stays fp64)."""
    acc = torch.promote_types(x.dtype, torch.float32)
    y = torch.tanh(alpha.to(acc).reshape(()) * x.to(acc)) * weight.to(acc)
    if bias is not None:
        y = y + bias.to(acc)
    return y.to(x.dtype)


def _param(x: torch.Tensor, name: str, p: torch.Tensor) -> None:
    check.tensor(OP_ID, name, p)
    check.floating(OP_ID, name, p)
    if p.dim() != 1 or p.shape[0] != x.shape[-1]:
        raise check.OpArgumentError(OP_ID, name, f"expected shape ({x.shape[-1]},) to match x's last dim, got {tuple(p.shape)}")
    check.same_device(OP_ID, name, p, "x", x)


def validate(x: torch.Tensor, alpha: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    check.tensor(OP_ID, "x", x)
    check.floating(OP_ID, "x", x)
    check.tensor(OP_ID, "alpha", alpha, min_dim=0)
    check.floating(OP_ID, "alpha", alpha)
    if alpha.shape not in ((), (1,)):
        raise check.OpArgumentError(OP_ID, "alpha", f"expected a 0-dim or 1-element ([1]) tensor, got shape {tuple(alpha.shape)}")
    check.same_device(OP_ID, "alpha", alpha, "x", x)
    _param(x, "weight", weight)
    if bias is not None:
        _param(x, "bias", bias)


_grad_enabled = torch.is_grad_enabled


def _param_class(p: torch.Tensor | None) -> tuple | None:
    return None if p is None else (p.dtype, p.shape, p.device)


def _key(x: torch.Tensor, alpha: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> tuple:
    """The argument class. It holds everything validity depends on, so `validate` runs once per
    class (on the memo miss), not per call. The guard (``_op``'s ``guard``) recognises a repeat
    of it without building it: x's last dim and the parameters' whole shapes (or None)."""
    needs_grad = (x.requires_grad or alpha.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)) and (
        _grad_enabled()
    )
    return (x.device, x.dtype, needs_grad, x.shape[-1], _param_class(alpha), _param_class(weight), _param_class(bias))


_op: Op  # defined below, after the public function it serves (with _dispatch, its dispatch)


def dyt(
    x: torch.Tensor, alpha: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, impl: str | None = None
) -> torch.Tensor:
    """Dynamic Tanh over x's last dim: ``weight·tanh(alpha·x) + bias``, computed in fp32.

    >>> import torch, polykernel
    >>> x, alpha, w = torch.randn(4, 8), torch.tensor(0.5), torch.ones(8)
    >>> polykernel.dyt(x, alpha, w).shape
    torch.Size([4, 8])
    >>> y = polykernel.dyt(x, alpha, w, torch.zeros(8), impl="torch")  # with a bias, forced impl
    """
    return _dispatch(impl, x, alpha, weight, bias)  # _op.dispatch; the class and validation: see _key


# -- error model (see polykernel.core.op.ErrorModel) --------------------------------------------------
# y = w·t + b, t = tanh(alpha·x): a tanh (a few ulps; its argument's rounding adds at most one, as
# |z·tanh'(z)/tanh(z)| <= 1) and a multiply, relative (tiny x too); w·t + b may cancel: absolutely,
# relative to max|w| + max|b| (|t| <= 1). Backward: 1 - t² from a rounded t is off by ~2·u32 absolutely (torch
# computes it so), so g = dy·w·(1 - t²) is off by ~u32·max|w| (|dy| <= 1): dx = alpha·g relative to
# |alpha|·max|w|; dalpha = Σ g·x over all M·N elements, each term off by ~u32·|w·x|, random signs:
# relative to ‖w·x‖₂ (and the sum's own growth); dW = Σ_rows dy·t and dB = Σ_rows dy over M rows
# of terms <= 1, random signs: relative to √M.
def error_model(x: torch.Tensor, alpha: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Bounds:
    rows, _ = rows_and_len(x)
    a = abs(alpha.detach().double().reshape(-1)[0].item()) if alpha.numel() else 0.0
    w_max = weight.detach().abs().max().item() if weight.numel() else 0.0
    b_max = bias.detach().abs().max().item() if bias is not None and bias.numel() else 0.0
    wx = (x.detach().double() * weight.detach().double()).norm().item() if x.numel() else 0.0
    y = ErrorModel(ops=8, cancel=4 if bias is not None else 0, scale=w_max + b_max)  # no bias: nothing cancels
    dx = ErrorModel(ops=8, cancel=4, scale=a * w_max)
    dalpha = ErrorModel(ops=8, cancel=4 * SUM_LAMBDA, sum_abs=1, n=max(x.numel(), 1), scale=wx)
    dwb = ErrorModel(ops=8, cancel=2 * SUM_LAMBDA, sum_abs=1 + SUM_LAMBDA, n=max(rows, 1), scale=max(rows, 1) ** 0.5)
    return Bounds(outputs=(y,), grads={0: dx, 1: dalpha, 2: dwb, 3: dwb})


def example(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str, requires_grad: bool = False) -> Case:
    """Random arguments of a given x shape (benchmarks, ``explain --shape``, the demo)."""
    x = torch.randn(shape, dtype=dtype, device=device, requires_grad=requires_grad)
    alpha = torch.full((1,), 0.5, dtype=dtype, device=device, requires_grad=requires_grad)
    w = (1 + 0.1 * torch.randn(shape[-1], device=device)).to(dtype).requires_grad_(requires_grad)
    b = (0.1 * torch.randn(shape[-1], device=device)).to(dtype).requires_grad_(requires_grad)
    return Case(f"{'x'.join(map(str, shape))}", (x, alpha, w, b))


def bytes_moved(
    x: torch.Tensor, alpha: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *_: object, backward: bool = False
) -> int:
    """Fewest bytes: forward reads x and writes y; backward adds x, dy read and dx written; the
    parameters are read once each way and their gradients written once."""
    n = x.numel() * x.element_size()
    params = sum(p.numel() * p.element_size() for p in (weight, bias) if p is not None)
    return (5 if backward else 2) * n + params * (3 if backward else 1)


def cases(device: torch.device | str, dtype: torch.dtype, large: bool = False) -> list[Case]:
    """Awkward shapes and every option, sized for the CPU interpreter unless ``large``."""

    def t(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(shape, device=device)).to(dtype).requires_grad_()

    def a(value: float, shape: tuple[int, ...] = (1,), pdtype: torch.dtype = dtype) -> torch.Tensor:
        return torch.full(shape, value, device=device).to(pdtype).requires_grad_()

    def w(n: int, pdtype: torch.dtype = dtype) -> torch.Tensor:
        return (1 + 0.1 * torch.randn(n, device=device)).to(pdtype).requires_grad_()

    def b(n: int, pdtype: torch.dtype = dtype) -> torch.Tensor:
        return (0.1 * torch.randn(n, device=device)).to(pdtype).requires_grad_()

    return [
        Case("1x1", (t(1, 1), a(0.5), w(1), b(1))),
        Case("7-1d", (t(7), a(0.5), w(7), None)),
        Case("3x7", (t(3, 7), a(0.8), w(7), b(7))),
        Case("2x5x33-alpha-0d", (t(2, 5, 33), a(0.5, ()), w(33), b(33))),
        Case("0x16", (t(0, 16), a(0.5), w(16), b(16))),
        Case("2x3x0", (t(2, 3, 0), a(0.5), w(0), b(0))),
        Case("5x96-no-bias", (t(5, 96), a(1.5), w(96), None)),
        Case("6x80-small-x", (t(6, 80, scale=1e-3), a(0.5), w(80), None)),  # tanh's relative accuracy near 0
        Case("4x100-saturated", (t(4, 100, scale=30.0), a(2.0), w(100), b(100))),  # |alpha·x| >> 1: tanh -> ±1, 1 - t² -> 0
        Case("4x64-fp32-params", (t(4, 64), a(0.5, pdtype=torch.float32), w(64, torch.float32), b(64, torch.float32))),
        Case("9x200-rowstrided", (t(18, 200)[::2], a(0.5), w(200), b(200))),
        Case("7x64-colstrided", (t(7, 128)[:, ::2], a(-0.7), w(128)[::2], b(192)[::3])),
        Case("3x9001-column-blocks", (t(3, 9001), a(0.5), w(9001), b(9001))),  # 3 column blocks, the last partial
        Case("300x40-many-rows", (t(300, 40), a(0.5), w(40), b(40))),
    ] + (
        [
            Case("16384x4096", (t(16384, 4096), a(0.5), w(4096), b(4096))),
            Case("4096x16384-fp32-params", (t(4096, 16384), a(0.5, pdtype=torch.float32), w(16384, torch.float32), None)),
            Case("1031x5120-odd", (t(1031, 5120), a(0.5), w(5120), b(5120))),
            Case("64x262144", (t(64, 262144), a(0.5), w(262144), b(262144))),
        ]
        if large
        else []
    )


def outputs(x: torch.Tensor, *_: object) -> tuple[tuple[torch.Size, torch.dtype], ...]:
    """The reference's output shape and dtype, without running it (the first-call check)."""
    return ((x.shape, x.dtype),)


_op = Op(
    OP_ID,
    fields=("device", "dtype", "needs_grad", "n", "alpha", "weight", "bias"),
    key=_key,
    guard=(LAST, SHAPE, SHAPE, SHAPE),
    default_key=lambda device, dtype: (device, dtype, False, None, None, None, None),
    validate=validate,
    reference=reference,
    outputs=outputs,
    error_model=error_model,
    dtypes=(torch.float32, torch.bfloat16, torch.float16),
    cases=cases,
    example=example,
    bytes_moved=bytes_moved,
    # impls: none here, each backend registers its own (its manifest.py: polykernel.backends)
    dtensor_layout=Layout(ROWS, rows_with(), (0,)),  # rows are independent; the parameters replicated
)
_dispatch = _op.dispatch  # bound once: ~30 ns less per call than the attribute lookup
