"""``activation.swiglu``: ``silu(gate) * up``, elementwise.

gate and up have the same shape, dtype and device (any shape, 0-d included); the math is fp32
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

OP_ID = "activation.swiglu"


def reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The semantics, in plain torch (fp32 math; fp64 stays fp64)."""
    acc = torch.promote_types(gate.dtype, torch.float32)
    return (F.silu(gate.to(acc)) * up.to(acc)).to(gate.dtype)


def validate(gate: torch.Tensor, up: torch.Tensor) -> None:
    validate_glu(OP_ID, gate, up)


def _key(gate: torch.Tensor, up: torch.Tensor, *_: object, **__: object) -> tuple:
    """The argument class; with up_matches it holds everything validity depends on, so `validate`
    runs once per class (on the memo miss). n (the row length) is in it because an impl's
    eligibility depends on it (Liger: N <= 65536). The guard (``_op``'s ``guard``) recognises a
    repeat without building it: gate's last dim, and up's shape compared with gate's per call."""
    return (gate.device, gate.dtype, check.needs_grad(gate, up), gate.shape[-1] if gate.dim() else 1, up_matches(gate, up))


_op: Op  # defined below, after the public function it serves (with _dispatch, its dispatch)


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, impl: str | None = None) -> torch.Tensor:
    """``silu(gate) * up`` (the SwiGLU MLP's gate), computed in fp32, in gate's dtype.

    >>> import torch, polykernel
    >>> gate, up = torch.randn(4, 8), torch.randn(4, 8)
    >>> polykernel.swiglu(gate, up).shape
    torch.Size([4, 8])
    >>> y = polykernel.swiglu(gate, up, impl="torch")  # forced impl
    """
    return _dispatch(impl, gate, up)  # _op.dispatch; the class and validation: see _key


# -- error model (see polykernel.core.op.ErrorModel) --------------------------------------------------
# Each value is one fp32 expression rounded once. silu(g) = g·σ(g): an exp whose argument carries
# |g|·u32 of relative error (GPUs evaluate exp as exp2(g·log2 e)), a few more roundings. d_gate =
# dy·up·σ·(1 + g·(1 - σ)) cancels near g = -1.28: relative to its terms' magnitude, ~1.1·max|up|
# for cotangents |dy| <= 1.
# fp32 math evaluates σ(g) = 1/(1 + exp(-g)), and exp overflows once -g > ln(FLT_MAX) = 88.72: σ(g)
# and g·σ(g) then come back 0 where the exact |g·σ(g)| is up to 88.73/FLT_MAX = 2.6e-37 (torch's
# and Liger's silu(-94) = -0, exact -6e-39). An absolute error of up to this
# much times what multiplies σ is the math's, not an impl's, fault.
SIGMOID_UNDERFLOW_FP32 = 88.73 / 3.4028234663852886e38


def error_model(gate: torch.Tensor, up: torch.Tensor) -> Bounds:
    g_max = gate.detach().abs().max().item() if gate.numel() else 0.0
    u_max = up.detach().abs().max().item() if up.numel() else 0.0
    out = ErrorModel(ops=6 + g_max, floor=SIGMOID_UNDERFLOW_FP32 * max(u_max, 1.0))  # σ(g) = 0 once exp(-g) overflows
    d_gate = ErrorModel(ops=6 + g_max, cancel=4 + g_max, scale=1.1 * u_max)
    return Bounds(outputs=(out,), grads={0: d_gate, 1: out})


def cases(device: torch.device | str, dtype: torch.dtype, large: bool = False) -> list[Case]:
    """Awkward shapes and layouts, sized for the CPU interpreter unless ``large``."""
    return glu_cases(device, dtype, large)


def outputs(gate: torch.Tensor, *_: object) -> tuple[tuple[torch.Size, torch.dtype], ...]:
    """The reference's output shape and dtype, without running it (the first-call check)."""
    return ((gate.shape, gate.dtype),)


_op = Op(
    OP_ID,
    fields=("device", "dtype", "needs_grad", "n", "up_matches"),
    key=_key,
    guard=(LAST, 0),
    default_key=lambda device, dtype: (device, dtype, False, None, True),
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
