"""``activation.geglu``: ``gelu(gate, approximate) * up``, elementwise.

``approximate="tanh"`` (the default, as in Gemma) is the tanh approximation of GELU; ``"none"``
is the exact erf form. gate and up have the same shape, dtype and device; the math is fp32
(fp64 stays fp64) and the output has gate's dtype. Gradients flow to both inputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..backends.liger import _gates as liger_gates
from ..op import Case, Op, Tol, Tolerances
from ..spec import CapabilityRequirement, FormatSignature, KernelSpec
from . import _checks as check
from ._glu import bytes_moved, example, glu_cases, validate_glu

OP_ID = "activation.geglu"
APPROXIMATIONS = ("tanh", "none")


def reference(gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """The semantics, in plain torch (fp32 math; fp64 stays fp64)."""
    acc = torch.promote_types(gate.dtype, torch.float32)
    return (F.gelu(gate.to(acc), approximate=approximate) * up.to(acc)).to(gate.dtype)


def validate(gate: torch.Tensor, up: torch.Tensor, approximate: str) -> None:
    validate_glu(OP_ID, gate, up)
    check.choice(OP_ID, "approximate", approximate, APPROXIMATIONS)


def _key(gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh", *_: object, **__: object) -> tuple:
    # approximate is in the class because an impl's eligibility depends on it (Liger: tanh only)
    return (gate.device, gate.dtype, check.needs_grad(gate, up), approximate)


_op: Op  # defined below, after the public function it serves


def geglu(gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh", *, impl: str | None = None) -> torch.Tensor:
    """``gelu(gate, approximate) * up`` (the GeGLU MLP's gate), computed in fp32, in gate's dtype.

    >>> import torch, polykernel
    >>> gate, up = torch.randn(4, 8), torch.randn(4, 8)
    >>> polykernel.geglu(gate, up).shape
    torch.Size([4, 8])
    >>> y = polykernel.geglu(gate, up, "none", impl="torch")  # exact erf GELU, forced impl
    """
    validate(gate, up, approximate)
    return _op.call(impl, (gate.device, gate.dtype, check.needs_grad(gate, up), approximate), gate, up, approximate)


# -- tolerances: measured errors of the impls against `reference`, with headroom ----------------
# The reference is itself only accurate to ~1e-7 *absolute* in the cdf: for g << 0, torch's
# 0.5·(1 + tanh z) and 0.5·(1 + erf(g/√2)) cancel (the CPU's vectorized erf adds its own ~1e-7),
# while the Triton impl evaluates the tanh form as sigmoid(2z) (no cancellation). Out there the
# two differ by ~1e-7·|g·up| forward and ~1e-6·|up·dy| backward (gelu' = cdf + g·pdf, and
# 1 - tanh² is also a cancellation; torch returns exactly 0 where the true value is ~1e-6), hence
# atol 1e-5 / 5e-5 for every dtype, for values that are O(1). Elsewhere the results are one fp32
# expression rounded once, so a one-ulp flip of the output dtype (rtol: bf16 2^-7, fp16 2^-10).
TOLERANCES = Tolerances(
    forward={
        torch.float32: Tol(atol=1e-5, rtol=1e-5),
        torch.float64: Tol(atol=1e-12, rtol=1e-12),
        torch.bfloat16: Tol(atol=1e-5, rtol=1e-2),
        torch.float16: Tol(atol=1e-5, rtol=1.25e-3),
    },
    backward={
        torch.float32: Tol(atol=5e-5, rtol=1e-5),
        torch.float64: Tol(atol=1e-12, rtol=1e-12),
        torch.bfloat16: Tol(atol=5e-5, rtol=1e-2),
        torch.float16: Tol(atol=5e-5, rtol=1.25e-3),
    },
)


def cases(device: torch.device | str, dtype: torch.dtype, large: bool = False) -> list[Case]:
    """Awkward shapes and layouts for both approximations, sized for the CPU interpreter unless ``large``."""
    return glu_cases(device, dtype, large) + [
        Case(f"erf-{c.label}", c.args, {"approximate": "none"}) for c in glu_cases(device, dtype, large)
    ]


_TRITON_DTYPES = FormatSignature(supported_dtypes=("float32", "bfloat16", "float16"))

# Peers (Liger-Kernel 0.8.5, QuACK 0.6.5): adapters in polykernel/backends/{liger,quack}/<op>.py,
# predicates in backends/{liger,quack}/_gates.py. Ranks are static until measured selection
# lands; the figures are ../shared/gpu/README.md's (H200, bf16, CUDA-graph replays, TB/s).
IMPLS = [
    KernelSpec(
        OP_ID,
        "torch",
        "polykernel.backends.torch.geglu:geglu",
        rank=100,
        description="the reference's fp32 math; backward saves only gate and up",
    ),
    KernelSpec(
        OP_ID,
        "triton",
        "polykernel.backends.triton.geglu:geglu",
        capabilities=frozenset({CapabilityRequirement.CUDA}),
        requires_modules=("triton",),
        format_signature=_TRITON_DTYPES,
        rank=10,
        description="one elementwise pass each way (flat or row-strided, 16-byte accesses); backward recomputes gelu",
    ),
    # Liger: fwd 2.62 vs our 4.31, fwd+bwd 3.21 vs 4.32 at 16384x14336: behind Triton. It refuses
    # N > 65536 at run time (the argument class has no N for a predicate).
    KernelSpec(
        OP_ID,
        "liger",
        "polykernel.backends.liger.geglu:geglu",
        capabilities=frozenset({CapabilityRequirement.CUDA}),
        requires_modules=("liger_kernel", "triton"),
        format_signature=_TRITON_DTYPES,
        rank=30,
        description="Liger LigerGELUMulFunction (tanh only); gate/up copied when grad is on",
        predicate=liger_gates.geglu,
    ),
]

_op = Op(
    OP_ID,
    fields=("device", "dtype", "needs_grad", "approximate"),
    key=_key,
    default_key=lambda device, dtype: (device, dtype, False, "tanh"),
    reference=reference,
    tolerances=TOLERANCES,
    dtypes=(torch.float32, torch.bfloat16, torch.float16),
    cases=cases,
    example=example,
    bytes_moved=bytes_moved,
    impls=IMPLS,
)
