"""``norm.fused_add_rms_norm``: ``s = x + residual``, returns ``(rms_norm(s, weight, eps, offset=offset), s)``.

The pre-norm transformer step: add the block's output to the residual stream, normalize the new
stream. ``x`` and ``residual`` have the same shape and dtype; ``s`` is rounded to that dtype exactly
as PyTorch's ``x + residual`` rounds it, and the normalization runs on that rounded ``s`` with
``rms_norm``'s ``casting="fp32"`` semantics (fp32 math, one cast at the end; ``offset=1.0`` is
Gemma's ``1 + w``). Both outputs have x's dtype; the weight may have another floating dtype.
``x`` and ``residual`` both get the gradient of ``s``: the incoming gradient of the second
output plus the normalization's contribution.
"""

from __future__ import annotations

import torch

from ..core.hit_guard import LAST, SHAPE
from ..core.op import Bounds, Case, ErrorModel, Op, rows_and_len
from ..distributed.layout import ROWS, Layout, rows_with
from . import _checks as check
from .rms_norm import dx_terms
from .rms_norm import reference as rms_norm_reference

OP_ID = "norm.fused_add_rms_norm"


def reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, offset: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The semantics, in plain torch: PyTorch's rounded sum, then ``rms_norm`` (casting ``"fp32"``)."""
    s = x + residual
    return rms_norm_reference(s, weight, eps, offset, "fp32"), s


def validate(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> None:
    check_arguments(OP_ID, x, residual, weight, eps, offset)


def check_arguments(op_id: str, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> None:
    """The checks of this op's arguments, naming ``op_id`` (the serving op in place shares them)."""
    check.tensor(op_id, "x", x)
    check.floating(op_id, "x", x)
    check.tensor(op_id, "residual", residual)
    if residual.dtype != x.dtype:
        raise check.OpTypeError(op_id, "residual", f"expected x's dtype {x.dtype}, got {residual.dtype}")
    if residual.shape != x.shape:
        raise check.OpArgumentError(op_id, "residual", f"expected x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    check.same_device(op_id, "residual", residual, "x", x)
    check.tensor(op_id, "weight", weight)
    check.floating(op_id, "weight", weight)
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise check.OpArgumentError(op_id, "weight", f"expected shape ({x.shape[-1]},) to match x's last dim, got {tuple(weight.shape)}")
    check.same_device(op_id, "weight", weight, "x", x)
    check.eps(op_id, eps)
    check.finite_float(op_id, "offset", offset)


_grad_enabled = torch.is_grad_enabled


def _key(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, offset: float = 0.0) -> tuple:
    """The argument class. It holds everything validity depends on (residual's match with x as
    one flag, so a new sequence length needs no new decision), so `validate` runs once per class.
    The guard (``_op``'s ``guard``) recognises a repeat without building it: x's last dim, weight's
    shape, and residual's shape compared with x's on each call."""
    needs_grad = (x.requires_grad or residual.requires_grad or weight.requires_grad) and _grad_enabled()
    same = residual.shape == x.shape and residual.dtype == x.dtype and residual.device == x.device
    return (x.device, x.dtype, needs_grad, x.shape[-1], weight.dtype, same, weight.shape, weight.device, eps, offset)


_op: Op  # defined below, after the public function it serves (with _dispatch, its dispatch)


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    offset: float = 0.0,
    impl: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + residual``; return ``(rms_norm(s, weight, eps, offset=offset), s)``.

    >>> import torch, polykernel
    >>> x, r, w = torch.randn(4, 8), torch.randn(4, 8), torch.ones(8)
    >>> y, s = polykernel.fused_add_rms_norm(x, r, w)
    >>> torch.equal(s, x + r)
    True
    >>> y, s = polykernel.fused_add_rms_norm(x, r, w, offset=1.0, impl="torch")  # Gemma style, forced impl
    """
    return _dispatch(impl, x, residual, weight, eps, offset)  # _op.dispatch; the class and validation: see _key


# -- error model (see polykernel.core.op.ErrorModel) --------------------------------------------------
# s = x + residual is one fp32 sum rounded once. y is rms_norm's model on s, with one more
# rounding: the semantics normalize the rounded s, the exact result the exact one. Gradients: ds =
# d(s_out) + rms_norm's dx (cancelling terms, magnitude max(1, rms_norm's)), where the rounding of
# s, and the reference's rounding of the normalization's part before the add, move terms by up to
# an ulp each; dW = Σ dy·ŝ over M rows, random signs, with ŝ from the rounded s.
def error_model(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, offset: float = 0.0) -> Bounds:
    rows, n = rows_and_len(x)
    y = ErrorModel(rounds=2, ops=8, sum_rel=0.5, n=n, nonfinite_rows=True)
    s = ErrorModel(ops=1)
    terms = max(1.0, dx_terms(x.detach() + residual.detach(), weight, eps, offset))
    ds = ErrorModel(ops=4, sum_rel=0.5, cancel=8, sum_abs=1, rounds_abs=2, n=n, scale=terms)
    dw = ErrorModel(ops=4, cancel=4, sum_abs=1, rounds_abs=2, n=rows, inter=x.dtype)
    return Bounds(outputs=(y, s), grads={0: ds, 1: ds, 2: dw})


def example(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str, requires_grad: bool = False) -> Case:
    """Random arguments of a given x shape (benchmarks, ``explain --shape``, the demo)."""
    x = torch.randn(shape, dtype=dtype, device=device, requires_grad=requires_grad)
    r = torch.randn(shape, dtype=dtype, device=device, requires_grad=requires_grad)
    w = (1 + 0.1 * torch.randn(shape[-1], device=device)).to(dtype).requires_grad_(requires_grad)
    return Case(f"{'x'.join(map(str, shape))}", (x, r, w))


def bytes_moved(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, *_: object, backward: bool = False) -> int:
    """Fewest bytes: forward reads x, residual, writes y, s (4·M·N); backward adds s, dy, d(s_out)
    read and d(s) written (one gradient tensor serves x and residual): 8·M·N elements in all."""
    n = x.numel() * x.element_size()
    return (8 if backward else 4) * n + weight.numel() * weight.element_size() * (3 if backward else 1)


def cases(device: torch.device | str, dtype: torch.dtype, large: bool = False) -> list[Case]:
    """Awkward shapes and every option, sized for the CPU interpreter unless ``large``."""

    def t(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(shape, device=device)).to(dtype).requires_grad_()

    def w(n: int, wdtype: torch.dtype = dtype) -> torch.Tensor:
        return (1 + 0.1 * torch.randn(n, device=device)).to(wdtype).requires_grad_()

    out = [
        Case("1x1", (t(1, 1), t(1, 1), w(1))),
        Case("3x7", (t(3, 7), t(3, 7), w(7))),
        Case("2x5x33", (t(2, 5, 33), t(2, 5, 33), w(33))),
        Case("0x16", (t(0, 16), t(0, 16), w(16))),
        Case("2x3x0", (t(2, 3, 0), t(2, 3, 0), w(0))),
        Case("6x128-big-residual", (t(6, 128, scale=0.05), t(6, 128, scale=20.0), w(128))),  # the sum's rounding matters
        Case("5x96-gemma", (t(5, 96), t(5, 96), w(96)), {"offset": 1.0, "eps": 1e-5}),
        Case("4x64-fp32w", (t(4, 64), t(4, 64), w(64, torch.float32))),
        Case("9x200-rowstrided", (t(18, 200)[::2], t(9, 200), w(200))),
        Case("7x64-colstrided", (t(7, 64), t(7, 128)[:, ::2], w(128)[::2])),
        Case("3x70001-long", (t(3, 70001), t(3, 70001), w(70001))),
    ]
    if large:
        out += [
            Case("16384x4096", (t(16384, 4096), t(16384, 4096), w(4096))),
            Case("4096x16384", (t(4096, 16384), t(4096, 16384), w(16384))),
            Case("1031x5120-fp32w", (t(1031, 5120), t(1031, 5120), w(5120, torch.float32))),
            Case("64x262144", (t(64, 262144), t(64, 262144), w(262144))),
        ]
    return out


def outputs(x: torch.Tensor, residual: torch.Tensor, *_: object) -> tuple[tuple[torch.Size, torch.dtype], ...]:
    """The reference's output shapes and dtypes, without running it (the first-call check)."""
    s = (torch.broadcast_shapes(x.shape, residual.shape), torch.promote_types(x.dtype, residual.dtype))
    return (s, s)


_op = Op(
    OP_ID,
    fields=("device", "dtype", "needs_grad", "n", "weight_dtype", "residual_matches", "weight_shape", "weight_device", "eps", "offset"),
    key=_key,
    guard=(LAST, 0, SHAPE, None, None),
    default_key=lambda device, dtype: (device, dtype, False, None, dtype, True, None, device, 1e-6, 0.0),
    validate=validate,
    reference=reference,
    outputs=outputs,
    error_model=error_model,
    dtypes=(torch.float32, torch.bfloat16, torch.float16),
    cases=cases,
    example=example,
    bytes_moved=bytes_moved,
    # impls: none here, each backend registers its own (its manifest.py: polykernel.backends)
    # torch.compile: Inductor's code is as fast (its torch.compile rows in benchmarks/results/h200-2026-11-30-graph.json),
    # so the op decomposes and Inductor fuses it with its neighbours
    compile_mode="decompose",
    dtensor_layout=Layout(ROWS, rows_with(1), (0, 0)),
)
_dispatch = _op.dispatch  # bound once: ~30 ns less per call than the attribute lookup
