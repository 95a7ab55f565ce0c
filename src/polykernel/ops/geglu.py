"""``activation.geglu``: ``gelu(gate, approximate) * up``, elementwise.

``approximate="tanh"`` (the default, as in Gemma) is the tanh approximation of GELU; ``"none"``
is the exact erf form. gate and up have the same shape, dtype and device; the math is fp32
(fp64 stays fp64) and the output has gate's dtype. Gradients flow to both inputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..core.hit_guard import LAST
from ..core.op import Bounds, Case, ErrorModel, Op
from ..distributed.layout import ANY, Layout, rows_with
from . import _checks as check
from ._glu import bytes_moved, example, glu_cases, up_matches, validate_glu

OP_ID = "activation.geglu"
APPROXIMATIONS = ("tanh", "none")
_INF = float("inf")


def gelu(g: torch.Tensor, approximate: str) -> torch.Tensor:
    """``F.gelu`` with torch's scalar answer at +inf on every path: gelu(+inf) = +inf (so the
    product is inf·up), where PyTorch's vectorized fp32 CPU erf-GELU gives NaN (its scalar path,
    fp64, CUDA and our kernels give inf). gelu(-inf) stays NaN (-inf·Φ(-inf) = -inf·0), as every
    torch path and every impl (ours and the peers') computes it; gelu_and_mul shares this."""
    return torch.where(g == _INF, g, F.gelu(g, approximate=approximate))


def reference(gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """The semantics, in plain torch (fp32 math; fp64 stays fp64)."""
    acc = torch.promote_types(gate.dtype, torch.float32)
    return (gelu(gate.to(acc), approximate) * up.to(acc)).to(gate.dtype)


def validate(gate: torch.Tensor, up: torch.Tensor, approximate: str) -> None:
    validate_glu(OP_ID, gate, up)
    check.choice(OP_ID, "approximate", approximate, APPROXIMATIONS)


def _key(gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh", *_: object, **__: object) -> tuple:
    # approximate and n (the row length) are in the class because an impl's eligibility depends on
    # them (Liger: tanh only, N <= 65536)
    # up_matches: with it the class holds everything validity depends on (validate runs per class).
    # The guard (``_op``'s ``guard``) recognises a repeat without building it.
    return (gate.device, gate.dtype, check.needs_grad(gate, up), approximate, gate.shape[-1] if gate.dim() else 1, up_matches(gate, up))


_op: Op  # defined below, after the public function it serves (with _dispatch, its dispatch)


def geglu(gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh", *, impl: str | None = None) -> torch.Tensor:
    """``gelu(gate, approximate) * up`` (the GeGLU MLP's gate), computed in fp32, in gate's dtype.

    >>> import torch, polykernel
    >>> gate, up = torch.randn(4, 8), torch.randn(4, 8)
    >>> polykernel.geglu(gate, up).shape
    torch.Size([4, 8])
    >>> y = polykernel.geglu(gate, up, "none", impl="torch")  # exact erf GELU, forced impl
    """
    return _dispatch(impl, gate, up, approximate)  # _op.dispatch; the class and validation: see _key


# -- error model (see polykernel.core.op.ErrorModel) --------------------------------------------------
# Each value is one fp32 expression rounded once. gelu(g) = 0.5·g·(1 + tanh z) (or erf) cancels for
# g << 0, where torch's fp32 form is off by ~u32 of 0.5·|g| while the exact value is ~0: an error
# relative to max|g·up| (max|g| for d_up, cotangents |dy| <= 1). d_gate = dy·up·gelu'(g), where
# gelu' = 0.5·(1 + tanh z) + 0.5·g·z'·(1 - tanh² z): the second term's 1 - tanh² cancels too, and
# 0.5·|g|·z' reaches ~10 where tanh z rounds to ±1: ~16 u32 of max|up| (gelu' <= 1.13).
def error_model(gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh") -> Bounds:
    g, u = gate.detach().double(), up.detach().double()
    g_max = g.abs().max().item() if g.numel() else 0.0
    gu_max = (g * u).abs().max().item() if g.numel() else 0.0
    u_max = u.abs().max().item() if u.numel() else 0.0
    out = ErrorModel(ops=8, cancel=4, scale=gu_max)
    d_up = ErrorModel(ops=8, cancel=4, scale=g_max)
    d_gate = ErrorModel(ops=8, cancel=16, scale=1.13 * u_max)
    return Bounds(outputs=(out,), grads={0: d_gate, 1: d_up})


def cases(device: torch.device | str, dtype: torch.dtype, large: bool = False) -> list[Case]:
    """Awkward shapes and layouts for both approximations, sized for the CPU interpreter unless ``large``."""
    return glu_cases(device, dtype, large) + [
        Case(f"erf-{c.label}", c.args, {"approximate": "none"}) for c in glu_cases(device, dtype, large)
    ]


def outputs(gate: torch.Tensor, *_: object) -> tuple[tuple[torch.Size, torch.dtype], ...]:
    """The reference's output shape and dtype, without running it (the first-call check)."""
    return ((gate.shape, gate.dtype),)


_op = Op(
    OP_ID,
    fields=("device", "dtype", "needs_grad", "approximate", "n", "up_matches"),
    key=_key,
    guard=(LAST, 0, None),
    default_key=lambda device, dtype: (device, dtype, False, "tanh", None, True),
    validate=validate,
    reference=reference,
    outputs=outputs,
    error_model=error_model,
    dtypes=(torch.float32, torch.bfloat16, torch.float16),
    cases=cases,
    example=example,
    bytes_moved=bytes_moved,
    # impls: none here, each backend registers its own (its manifest.py: polykernel.backends)
    # torch.compile: Inductor's code ties ours at copy speed (the torch.compile rows of
    # benchmarks/results/h200-2026-11-30-graph.json), and it can fuse the decomposed op into the next matmul's input
    compile_mode="decompose",
    dtensor_layout=Layout(ANY, rows_with(1), (0,)),
)
_dispatch = _op.dispatch  # bound once: ~30 ns less per call than the attribute lookup
