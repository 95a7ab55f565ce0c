"""``serving.silu_and_mul``: x ``[..., 2d]`` -> ``silu(x[..., :d]) · x[..., d:]``, ``[..., d]``.

The serving layout of swiglu (vLLM's ``silu_and_mul``): one fused gate/up projection's output,
gate first. Math in fp32 (fp64 stays fp64), the result in x's dtype. ``out=`` writes the result
into a given tensor (x's dtype and device, shape ``[..., d]``, sharing no memory with x) and
returns it. Inference only (no autograd); CUDA-graph safe in every impl.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..backends.declare import impls
from ..backends.flashinfer import FLASHINFER
from ..backends.sgl_kernel import SGL_KERNEL
from ..backends.sgl_kernel import _gates as sgl_gates
from ..backends.torch import TORCH
from ..backends.torch_compile import TORCH_COMPILE
from ..backends.torch_compile import _gates as compile_gates
from ..backends.triton import TRITON
from ..core.op import Bounds, Case, Op
from . import _and_mul
from . import _serving as serving
from .swiglu import error_model as swiglu_error_model

OP_ID = "serving.silu_and_mul"


def reference(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The semantics, in plain torch (fp32 math; fp64 stays fp64); writes into ``out`` if given."""
    gate, up = _and_mul.halves(x)
    acc = torch.promote_types(x.dtype, torch.float32)
    y = F.silu(gate.to(acc)) * up.to(acc)
    return y.to(x.dtype) if out is None else out.copy_(y)


def validate(x: torch.Tensor, out: torch.Tensor | None = None) -> None:
    _and_mul.validate_and_mul(OP_ID, x, out)


_op: Op  # defined below, after the public function it serves


def silu_and_mul(x: torch.Tensor, *, out: torch.Tensor | None = None, impl: str | None = None) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for x ``[..., 2d]``, in x's dtype (into ``out`` if given).

    >>> import torch, polykernel
    >>> x = torch.randn(4, 16)
    >>> polykernel.silu_and_mul(x).shape
    torch.Size([4, 8])
    >>> out = torch.empty(4, 8)
    >>> polykernel.silu_and_mul(x, out=out) is out
    True
    """
    if not serving.compiling():  # every call: out's shape and memory are not in the argument class (compiled: the custom op checks)
        validate(x, out)
    return _op.call(impl, (x.device, x.dtype, False, x.shape[-1]), x, _and_mul.allocate(x, out))


# -- error model (see polykernel.core.op.ErrorModel) --------------------------------------------------
# swiglu's, on the two halves: each value is one fp32 expression rounded once (see ops/swiglu.py).
def error_model(x: torch.Tensor, out: torch.Tensor | None = None) -> Bounds:
    return swiglu_error_model(*_and_mul.halves(x))


def cases(device: torch.device | str, dtype: torch.dtype, large: bool = False) -> list[Case]:
    """Awkward shapes and layouts, sized for the CPU interpreter unless ``large``."""
    return _and_mul.and_mul_cases(device, dtype, large)


IMPLS = impls(
    OP_ID,
    TORCH.impl(rank=100, description="the reference's fp32 math, copied into out"),
    TRITON.impl(
        rank=10,
        supports_backward=False,
        description="swiglu's elementwise kernel on x's two halves (row-strided views: no copy), writing out",
    ),
    # Serving peers, unmeasured: behind Triton
    FLASHINFER.impl(rank=70, supports_backward=False, description="FlashInfer silu_and_mul (dense x and out, else copies)"),
    SGL_KERNEL.impl(
        rank=75,
        supports_backward=False,
        description="sgl-kernel silu_and_mul (rows in multiples of 16 bytes; dense x and out, else copies)",
        predicate=sgl_gates.silu_and_mul,
    ),
    # torch.compile: rank 110 (the backend's), behind torch: auto never pays its compile; measured
    # selection charges the compile (tuning/measure.py), impl="torch_compile" forces it.
    TORCH_COMPILE.impl(
        description="the reference under torch.compile(dynamic=True), Inductor writing into out; compiles on a class's first call",
        predicate=compile_gates.silu_and_mul,
    ),
)


# No guard: the public function validates every call (the overlap checks read the tensors memory),
# then hands over the argument class it built (Op.call).
_op = Op(
    OP_ID,
    fields=("device", "dtype", "needs_grad", "n"),
    key=_and_mul.key,
    default_key=lambda device, dtype: (device, dtype, False, None),
    validate=validate,
    reference=reference,
    outputs=_and_mul.outputs,
    error_model=error_model,
    dtypes=(torch.float32, torch.bfloat16, torch.float16),
    cases=cases,
    example=_and_mul.example,
    bytes_moved=_and_mul.bytes_moved,
    impls=IMPLS,
    writes=("out",),
)
