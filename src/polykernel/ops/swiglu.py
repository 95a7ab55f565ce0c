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
from ._glu import bytes_moved, example, glu_cases, validate_glu

OP_ID = "activation.swiglu"


def reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The semantics, in plain torch (fp32 math; fp64 stays fp64)."""
    acc = torch.promote_types(gate.dtype, torch.float32)
    return (F.silu(gate.to(acc)) * up.to(acc)).to(gate.dtype)


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


def cases(device: torch.device | str, dtype: torch.dtype, large: bool = False) -> list[Case]:
    """Awkward shapes and layouts, sized for the CPU interpreter unless ``large``."""
    return glu_cases(device, dtype, large)


_TRITON_DTYPES = FormatSignature(supported_dtypes=("float32", "bfloat16", "float16"))

# Peers (Liger-Kernel 0.8.5, QuACK 0.6.5): adapters in polykernel/backends/{liger,quack}/<op>.py,
# predicates in backends/{liger,quack}/_gates.py. Ranks are static until measured selection
# lands; the figures are ../shared/gpu/README.md's (H200, bf16, CUDA-graph replays, TB/s).
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
    # Liger: fwd 4.28 vs our 4.26, fwd+bwd 4.25 vs 4.29 at 16384x14336 (copy speed, a tie): behind
    # Triton. It refuses N > 65536 at run time (the argument class has no N for a predicate).
    KernelSpec(
        OP_ID,
        "liger",
        "polykernel.backends.liger.swiglu:swiglu",
        capabilities=frozenset({CapabilityRequirement.CUDA}),
        requires_modules=("liger_kernel", "triton"),
        format_signature=_TRITON_DTYPES,
        rank=30,
        description="Liger LigerSiLUMulFunction (silu(gate) rounded to up's dtype before the multiply); gate/up copied when grad is on",
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
