"""``activation.relu_squared``: ``relu(x)²``, elementwise (Primer, Nemotron's MLP activation).

Any shape (0-d included); the math is fp32 (fp64 stays fp64) and the output has x's dtype. As in
``torch.relu``, a NaN stays NaN (and ``-inf`` gives 0, ``inf`` gives ``inf``). Backward:
``dx = 2·relu(x)·dy``: 0 where ``x <= 0``, NaN where x is NaN (torch's relu backward).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..core.hit_guard import dims
from ..core.op import Bounds, Case, ErrorModel, Op
from ..distributed.layout import ANY, Layout, rows_with
from . import _checks as check

OP_ID = "activation.relu_squared"


def reference(x: torch.Tensor) -> torch.Tensor:
    """The semantics, in plain torch (fp32 math; fp64 stays fp64)."""
    acc = torch.promote_types(x.dtype, torch.float32)
    return F.relu(x.to(acc)).square().to(x.dtype)


def validate(x: torch.Tensor) -> None:
    check.tensor(OP_ID, "x", x, min_dim=0)
    check.floating(OP_ID, "x", x)


def _key(x: torch.Tensor) -> tuple:
    """The argument class: x's dtype (and device, grad) is all validity depends on; no size is
    checked, so the guard pins none (``dims()``)."""
    return (x.device, x.dtype, check.needs_grad(x))


_op: Op  # defined below, after the public function it serves (with _dispatch, its dispatch)


def relu_squared(x: torch.Tensor, *, impl: str | None = None) -> torch.Tensor:
    """``relu(x)²``, computed in fp32, in x's dtype.

    >>> import torch, polykernel
    >>> polykernel.relu_squared(torch.tensor([-2.0, 0.5, 3.0]))
    tensor([0.0000, 0.2500, 9.0000])
    >>> y = polykernel.relu_squared(torch.randn(4, 8), impl="torch")  # forced impl
    """
    return _dispatch(impl, x)  # _op.dispatch; the class and validation: see _key


# -- error model (see polykernel.core.op.ErrorModel) --------------------------------------------------
# y = r·r and dx = 2·r·dy (r = relu(x), exact): one fp32 product each, rounded once to x's dtype.
def error_model(x: torch.Tensor) -> Bounds:
    one = ErrorModel(ops=2)
    return Bounds(outputs=(one,), grads={0: one})


def example(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str, requires_grad: bool = False) -> Case:
    """Random arguments of one shape (benchmarks, ``explain --shape``, the demo)."""
    return Case(f"{'x'.join(map(str, shape))}", (torch.randn(shape, dtype=dtype, device=device, requires_grad=requires_grad),))


def bytes_moved(x: torch.Tensor, *_: object, backward: bool = False) -> int:
    """Fewest bytes: forward reads x and writes y (2·numel·size); the backward reads x, dy and
    writes dx, so forward+backward is 5·numel·size."""
    return (5 if backward else 2) * x.numel() * x.element_size()


def cases(device: torch.device | str, dtype: torch.dtype, large: bool = False) -> list[Case]:
    """Awkward shapes, layouts and non-finite values, sized for the CPU interpreter unless ``large``."""

    def t(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(shape, device=device)).to(dtype).requires_grad_()

    special = torch.tensor([float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1.5, -2.0], device=device)
    out = [
        Case("scalar", (t(),)),
        Case("1", (t(1),)),
        Case("3x7", (t(3, 7),)),
        Case("2x5x33", (t(2, 5, 33),)),
        Case("0x16", (t(0, 16),)),
        Case("9001-1d", (t(9001),)),
        Case("5x1000-wide-range", (t(5, 1000, scale=30.0),)),
        Case("nan-inf-zero", (special.repeat(3, 1).to(dtype).requires_grad_(),)),
        Case("7x48-transposed", (t(48, 7).t(),)),
        Case("5x40-colstrided", (t(5, 80)[:, ::2],)),
        Case("3x4x17-permuted", (t(4, 17, 3).permute(2, 0, 1),)),
        Case("3x70001-long", (t(3, 70001),)),
    ]
    if large:
        out += [
            Case("16384x14336", (t(16384, 14336),)),
            Case("3x1031x4097-odd", (t(3, 1031, 4097),)),
            Case("4096x4096-transposed", (t(4096, 4096).t(),)),
        ]
    return out


def outputs(x: torch.Tensor, *_: object) -> tuple[tuple[torch.Size, torch.dtype], ...]:
    """The reference's output shape and dtype, without running it (the first-call check)."""
    return ((x.shape, x.dtype),)


_op = Op(
    OP_ID,
    fields=("device", "dtype", "needs_grad"),
    key=_key,
    guard=(dims(),),
    default_key=lambda device, dtype: (device, dtype, False),
    validate=validate,
    reference=reference,
    outputs=outputs,
    error_model=error_model,
    dtypes=(torch.float32, torch.bfloat16, torch.float16),
    cases=cases,
    example=example,
    bytes_moved=bytes_moved,
    # impls: none here, each backend registers its own (its manifest.py: polykernel.backends)
    # torch.compile: an elementwise op, where Inductor's own code moves the bytes ours does (as fast
    # or faster, benchmarks/results/h200-2026-12-01-moreops-call.json) and fuses into its
    # neighbours: decomposed
    compile_mode="decompose",
    dtensor_layout=Layout(ANY, rows_with(), (0,)),  # elementwise: x may be sharded on any dim
)
_dispatch = _op.dispatch  # bound once: ~30 ns less per call than the attribute lookup
