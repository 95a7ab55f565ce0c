"""What the gated activations (swiglu, geglu) share: argument checks, parity cases, benchmark
inputs and bytes. Each op file keeps its own semantics (reference, tolerances, impls)."""

from __future__ import annotations

import torch

from ..core.op import Case
from . import _checks as check


def example(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str, requires_grad: bool = False) -> Case:
    """Random gate and up of one shape (benchmarks, ``explain --shape``, the demo)."""
    gate = torch.randn(shape, dtype=dtype, device=device, requires_grad=requires_grad)
    up = torch.randn(shape, dtype=dtype, device=device, requires_grad=requires_grad)
    return Case(f"{'x'.join(map(str, shape))}", (gate, up))


def bytes_moved(gate: torch.Tensor, *_: object, backward: bool = False) -> int:
    """Fewest bytes: forward reads gate, up and writes y (3·numel·size); the backward reads gate,
    up, dy and writes dgate, dup, so forward+backward is 8·numel·size."""
    return (8 if backward else 3) * gate.numel() * gate.element_size()


def up_matches(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """up has gate's shape, dtype and device: the argument-class field that lets the GLUs validate
    once per class instead of per call (the class holds only gate's last dimension)."""
    return up.shape == gate.shape and up.dtype == gate.dtype and up.device == gate.device


def validate_glu(op_id: str, gate: torch.Tensor, up: torch.Tensor) -> None:
    """Checks shared by the gated linear units (swiglu, geglu)."""
    check.tensor(op_id, "gate", gate, min_dim=0)
    check.floating(op_id, "gate", gate)
    check.tensor(op_id, "up", up, min_dim=0)
    check.floating(op_id, "up", up)
    if up.shape != gate.shape:
        raise check.OpArgumentError(op_id, "up", f"expected gate's shape {tuple(gate.shape)}, got {tuple(up.shape)}")
    if up.dtype != gate.dtype:
        raise check.OpTypeError(op_id, "up", f"expected gate's dtype {gate.dtype}, got {up.dtype}")
    check.same_device(op_id, "up", up, "gate", gate)


def glu_cases(device: torch.device | str, dtype: torch.dtype, large: bool, extra: dict | None = None) -> list[Case]:
    """Awkward shapes and layouts for a gated linear unit (shared by swiglu and geglu)."""
    kw = dict(extra or {})

    def t(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(shape, device=device)).to(dtype).requires_grad_()

    def fused(m: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        # the two halves of one [M, 2N] projection: row stride 2N, no copy needed
        both = t(m, 2 * n)
        return both[:, :n], both[:, n:]

    out = [
        Case("scalar", (t(), t()), kw),
        Case("1", (t(1), t(1)), kw),
        Case("3x7", (t(3, 7), t(3, 7)), kw),
        Case("2x5x33", (t(2, 5, 33), t(2, 5, 33)), kw),
        Case("0x16", (t(0, 16), t(0, 16)), kw),
        Case("9001-1d", (t(9001), t(9001)), kw),
        Case("5x1000-wide-range", (t(5, 1000, scale=8.0), t(5, 1000)), kw),
        Case("6x300-fused-halves", fused(6, 300), kw),
        Case("7x48-transposed", (t(48, 7).t(), t(48, 7).t()), kw),
        Case("7x48-mixed-layouts", (t(7, 48), t(48, 7).t()), kw),
        Case("5x40-colstrided", (t(5, 80)[:, ::2], t(5, 80)[:, ::2]), kw),
        Case("3x4x17-permuted", (t(4, 17, 3).permute(2, 0, 1), t(4, 17, 3).permute(2, 0, 1)), kw),
    ]
    if large:
        out += [
            Case("16384x14336", (t(16384, 14336), t(16384, 14336)), kw),
            Case("8192x11008-fused-halves", fused(8192, 11008), kw),
            Case("3x1031x4097-odd", (t(3, 1031, 4097), t(3, 1031, 4097)), kw),
            Case("4096x4096-transposed", (t(4096, 4096).t(), t(4096, 4096).t()), kw),
        ]
    return out
