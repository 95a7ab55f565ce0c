"""``activation.swiglu``: ``silu(gate) * up``, elementwise.

gate and up have the same shape, dtype and device (any shape, 0-d included); the math is fp32
(fp64 stays fp64) and the output has gate's dtype. Gradients flow to both inputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..op import Case, Op, Tol, Tolerances
from ..spec import CapabilityRequirement, FormatSignature, KernelSpec
from . import _checks as check

OP_ID = "activation.swiglu"


def reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The semantics, in plain torch (fp32 math; fp64 stays fp64)."""
    acc = torch.promote_types(gate.dtype, torch.float32)
    return (F.silu(gate.to(acc)) * up.to(acc)).to(gate.dtype)


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


def validate(gate: torch.Tensor, up: torch.Tensor) -> None:
    validate_glu(OP_ID, gate, up)


def _key(gate: torch.Tensor, up: torch.Tensor, *_: object, **__: object) -> tuple:
    return (gate.device, gate.dtype, check.needs_grad(gate, up))


_op: Op  # defined below, after the public function it serves


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, impl: str | None = None) -> torch.Tensor:
    """``silu(gate) * up`` (the SwiGLU MLP's gate), computed in fp32, in gate's dtype.

    >>> import torch, polykernel
    >>> gate, up = torch.randn(4, 8), torch.randn(4, 8)
    >>> polykernel.swiglu(gate, up).shape
    torch.Size([4, 8])
    >>> y = polykernel.swiglu(gate, up, impl="torch")  # forced impl
    """
    validate(gate, up)
    return _op.call(impl, (gate.device, gate.dtype, check.needs_grad(gate, up)), gate, up)


# -- tolerances: measured errors of the impls against `reference`, with headroom ----------------
# Forward: one fp32 product rounded once to the output dtype; impls differ from the reference
# only in how silu is evaluated (a few fp32 ulps, GPU fast exp included), which can flip the final
# rounding by one ulp: bf16 ulp <= 2^-7 relative, fp16 <= 2^-10; atol covers subnormal outputs.
# Backward: each gradient is again one rounded fp32 expression, so the same one-ulp bound.
TOLERANCES = Tolerances(
    forward={
        torch.float32: Tol(atol=1e-6, rtol=1e-5),
        torch.float64: Tol(atol=1e-12, rtol=1e-12),
        torch.bfloat16: Tol(atol=1e-5, rtol=1e-2),
        torch.float16: Tol(atol=1e-6, rtol=1.25e-3),
    },
    backward={
        torch.float32: Tol(atol=1e-6, rtol=1e-5),
        torch.float64: Tol(atol=1e-12, rtol=1e-12),
        torch.bfloat16: Tol(atol=1e-5, rtol=1e-2),
        torch.float16: Tol(atol=1e-6, rtol=1.25e-3),
    },
)


def example(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str, requires_grad: bool = False) -> Case:
    """Random gate and up of one shape (benchmarks, ``explain --shape``, the demo)."""
    gate = torch.randn(shape, dtype=dtype, device=device, requires_grad=requires_grad)
    up = torch.randn(shape, dtype=dtype, device=device, requires_grad=requires_grad)
    return Case(f"{'x'.join(map(str, shape))}", (gate, up))


def bytes_moved(gate: torch.Tensor, *_: object, backward: bool = False) -> int:
    """Fewest bytes: forward reads gate, up and writes y (3·numel·size); the backward reads gate,
    up, dy and writes dgate, dup, so forward+backward is 8·numel·size."""
    return (8 if backward else 3) * gate.numel() * gate.element_size()


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


def cases(device: torch.device | str, dtype: torch.dtype, large: bool = False) -> list[Case]:
    """Awkward shapes and layouts, sized for the CPU interpreter unless ``large``."""
    return glu_cases(device, dtype, large)


_TRITON_DTYPES = FormatSignature(supported_dtypes=("float32", "bfloat16", "float16"))

IMPLS = [
    KernelSpec(
        OP_ID,
        "torch",
        "polykernel.backends.torch.swiglu:swiglu",
        rank=100,
        description="the reference's fp32 math; backward saves only gate and up",
    ),
    KernelSpec(
        OP_ID,
        "triton",
        "polykernel.backends.triton.swiglu:swiglu",
        capabilities=frozenset({CapabilityRequirement.CUDA}),
        requires_modules=("triton",),
        format_signature=_TRITON_DTYPES,
        rank=10,
        description="one elementwise pass each way (flat or row-strided, 16-byte accesses); backward recomputes silu",
    ),
]

_op = Op(
    OP_ID,
    fields=("device", "dtype", "needs_grad"),
    key=_key,
    default_key=lambda device, dtype: (device, dtype, False),
    reference=reference,
    tolerances=TOLERANCES,
    dtypes=(torch.float32, torch.bfloat16, torch.float16),
    cases=cases,
    example=example,
    bytes_moved=bytes_moved,
    impls=IMPLS,
)
