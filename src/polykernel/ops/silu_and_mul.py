"""``serving.silu_and_mul``: x ``[..., 2d]`` -> ``silu(x[..., :d]) · x[..., d:]``, ``[..., d]``.

The serving layout of swiglu (vLLM's ``silu_and_mul``): one fused gate/up projection's output,
gate first. Math in fp32 (fp64 stays fp64), the result in x's dtype. ``out=`` writes the result
into a given tensor (x's dtype and device, shape ``[..., d]``, sharing no memory with x) and
returns it. Inference only (no autograd); CUDA-graph safe in every impl.

vLLM's CUDA kernel rounds ``silu(gate)`` to x's dtype before the multiply (two roundings, within
an ulp of this in 16-bit); FlashInfer's and sgl-kernel's round once, as here. vLLM takes
``d = n // 2`` of an odd last dim n and drops its last element; here an odd n is an error.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..core.hit_guard import SHAPE
from ..core.op import Bounds, Case, Op
from . import _and_mul
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


def _key(x: torch.Tensor, out: torch.Tensor | None = None) -> tuple:
    return _and_mul.key(x)


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
    if out is not None:  # every call: a given out's memory (the class holds the rest)
        _and_mul.check_memory(OP_ID, x, out)
    return _dispatch(impl, x, _and_mul.allocate(x, out))


# -- error model (see polykernel.core.op.ErrorModel) --------------------------------------------------
# swiglu's, on the two halves: each value is one fp32 expression rounded once (see ops/swiglu.py).
def error_model(x: torch.Tensor, out: torch.Tensor | None = None) -> Bounds:
    return swiglu_error_model(*_and_mul.halves(x))


def cases(device: torch.device | str, dtype: torch.dtype, large: bool = False) -> list[Case]:
    """Awkward shapes and layouts, sized for the CPU interpreter unless ``large``."""
    return _and_mul.and_mul_cases(device, dtype, large)


_op = Op(
    OP_ID,
    fields=("device", "dtype", "needs_grad", "n", "tokens"),
    key=_key,
    guard=(SHAPE, SHAPE),  # x's rows are its tokens' bucket; out's shape is part of its fit
    default_key=lambda device, dtype: (device, dtype, False, None, None),
    validate=validate,
    reference=reference,
    outputs=_and_mul.outputs,
    error_model=error_model,
    dtypes=(torch.float32, torch.bfloat16, torch.float16),
    cases=cases,
    example=_and_mul.example,
    bytes_moved=_and_mul.bytes_moved,
    # impls: none here, each backend registers its own (its manifest.py: polykernel.backends)
    writes=("out",),
    validate_each_call=True,
)
_dispatch = _op.dispatch
