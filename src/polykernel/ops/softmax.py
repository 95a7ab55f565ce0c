"""``activation.softmax``: ``exp(x - max) / Σ exp(x - max)`` over the last dim.

Math in fp32 (fp64 stays fp64), output in x's dtype; stable for any finite logits (the row max
is subtracted before exp) and for rows of any length. A row of all -inf gives NaN, like torch.
Backward: ``dx = y · (dy - Σ dy·y)``.
"""

from __future__ import annotations

import torch

from ..core.hit_guard import LAST
from ..core.op import Bounds, Case, ErrorModel, Op, rows_and_len
from ..distributed.layout import ROWS, Layout, rows_with
from . import _checks as check

OP_ID = "activation.softmax"


def reference(x: torch.Tensor) -> torch.Tensor:
    """The semantics, in plain torch (fp32 math; fp64 stays fp64)."""
    acc = torch.promote_types(x.dtype, torch.float32)
    return torch.softmax(x.to(acc), dim=-1).to(x.dtype)


def validate(x: torch.Tensor) -> None:
    check.tensor(OP_ID, "x", x)
    check.floating(OP_ID, "x", x)


def _key(x: torch.Tensor) -> tuple:
    """The argument class. It holds everything validity depends on (x's dtype; a 0-d x has no
    class), so `validate` runs once per class (on the memo miss). n (the row length) is in it
    because an impl's eligibility depends on it. The guard (``_op``'s ``guard``) recognises a
    repeat without building it: x's last dim."""
    return (x.device, x.dtype, check.needs_grad(x), x.shape[-1])


_op: Op  # defined below, after the public function it serves (with _dispatch, its dispatch)


def softmax(x: torch.Tensor, *, impl: str | None = None) -> torch.Tensor:
    """Softmax of ``x`` over its last dim, computed in fp32, in x's dtype.

    >>> import torch, polykernel
    >>> y = polykernel.softmax(torch.randn(4, 8))
    >>> bool(torch.allclose(y.sum(-1), torch.ones(4)))
    True
    >>> y = polykernel.softmax(torch.randn(4, 8), impl="torch")  # forced impl
    """
    return _dispatch(impl, x)  # _op.dispatch; the class and validation: see _key


# -- error model (see polykernel.core.op.ErrorModel) --------------------------------------------------
# y = exp(x - m) / Σ exp(x - m): the sum of N positive terms (relative), an exp and a division. A
# GPU exp evaluates exp2((x - m)·log2 e), whose rounded argument costs |x - m|·u32 of relative error:
# |x - m|·exp(-|x - m|) <= 1/e of the row's largest y, so absolute. Backward dx = y·(dy - Σ dy·y):
# dy - c cancels, so the error is relative to max(y)·max|dy| (|dy| <= 1), with c's sum over N.
def error_model(x: torch.Tensor) -> Bounds:
    _, n = rows_and_len(x)
    y_max = reference(x.detach().double()).nan_to_num().abs().max().item() if x.numel() else 0.0
    y = ErrorModel(ops=6, sum_rel=1, cancel=1, n=n, scale=y_max)
    dx = ErrorModel(ops=6, sum_rel=1, cancel=4, sum_abs=1, n=n, scale=y_max)
    return Bounds(outputs=(y,), grads={0: dx})


def example(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str, requires_grad: bool = False) -> Case:
    """Random logits of one shape (benchmarks, ``explain --shape``, the demo)."""
    x = torch.randn(shape, dtype=dtype, device=device, requires_grad=requires_grad)
    return Case(f"{'x'.join(map(str, shape))}", (x,))


def bytes_moved(x: torch.Tensor, *_: object, backward: bool = False) -> int:
    """Fewest bytes: forward reads x and writes y (2·numel·size); the backward reads y, dy and
    writes dx, so forward+backward is 5·numel·size."""
    return (5 if backward else 2) * x.numel() * x.element_size()


LONG_N = 40000  # > the Triton one-block limits (forward 32768, backward 16384): chunked paths
MID_N = 20000  # Triton: one-block forward, chunked backward


def cases(device: torch.device | str, dtype: torch.dtype, large: bool = False) -> list[Case]:
    """Awkward shapes, big logits and long rows, sized for the CPU interpreter unless ``large``."""

    def t(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(shape, device=device)).to(dtype).requires_grad_()

    def masked(m: int, n: int, start: int, stop: int) -> torch.Tensor:
        # causal-attention style: a run of -inf logits (covering whole chunks on long rows)
        x = 3 * torch.randn(m, n, device=device)
        x[:, start:stop] = float("-inf")
        return x.to(dtype).requires_grad_()

    out = [
        Case("1x1", (t(1, 1),)),
        Case("7", (t(7),)),
        Case("3x7", (t(3, 7),)),
        Case("2x5x33", (t(2, 5, 33),)),
        Case("0x16", (t(0, 16),)),
        Case("5x0", (t(5, 0),)),
        Case("4x1000-logits-1e4", (t(4, 1000, scale=1e4),)),
        Case("6x2048-masked", (masked(6, 2048, 0, 1500),)),
        Case("9x200-rowstrided", (t(18, 200)[::2],)),
        Case("7x64-colstrided", (t(7, 128)[:, ::2],)),
        Case("3x5x12-transposed", (t(3, 12, 5).transpose(1, 2),)),
        Case(f"8x{MID_N}-mid", (t(8, MID_N),)),
        Case(f"3x{LONG_N}-long", (t(3, LONG_N, scale=4.0),)),
        Case(f"2x{LONG_N}-long-masked", (masked(2, LONG_N, 0, 20000),)),
    ]
    if large:
        out += [
            Case("8192x32768", (t(8192, 32768),)),
            Case("16384x128", (t(16384, 128),)),
            Case("4x32x1024x1024-attn", (t(4, 32, 1024, 1024),)),
            Case("1031x50257-odd", (t(1031, 50257),)),
            Case("512x32768-logits-1e4", (t(512, 32768, scale=1e4),)),
            Case("64x262144-long", (t(64, 262144, scale=4.0),)),
            Case("1000x262144-long", (t(1000, 262144),)),
            Case("256x65537-masked", (masked(256, 65537, 0, 40000),)),
        ]
    return out


def outputs(x: torch.Tensor, *_: object) -> tuple[tuple[torch.Size, torch.dtype], ...]:
    """The reference's output shape and dtype, without running it (the first-call check)."""
    return ((x.shape, x.dtype),)


_op = Op(
    OP_ID,
    fields=("device", "dtype", "needs_grad", "n"),
    key=_key,
    guard=(LAST,),
    default_key=lambda device, dtype: (device, dtype, False, None),
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
    # benchmarks/results/h200-2026-11-30-graph.json); saves each row's max and 1/sum
    saved=("rows", "rows"),
    dtensor_layout=Layout(ROWS, rows_with(), (0,)),
)
_dispatch = _op.dispatch  # bound once: ~30 ns less per call than the attribute lookup
