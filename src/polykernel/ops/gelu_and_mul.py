"""``serving.gelu_and_mul``: x ``[..., 2d]`` -> ``gelu(x[..., :d], approximate) · x[..., d:]``.

The serving layout of geglu (vLLM's ``gelu_and_mul`` / ``gelu_tanh_and_mul``): one fused gate/up
projection's output, gate first. ``approximate="none"`` (the default, as vLLM's) is the exact erf
GELU, ``"tanh"`` its tanh approximation. Math in fp32 (fp64 stays fp64), the result in x's dtype;
``out=`` writes into a given tensor and returns it. Inference only; CUDA-graph safe.

vLLM's CUDA kernel rounds ``gelu(gate)`` to x's dtype before the multiply (FlashInfer's and
sgl-kernel's round once, as here), and drops the last element of an odd last dim (an error here).
FlashInfer's and sgl-kernel's tanh kernels use the hardware's approximate tanh
(``tanh.approx.f32``) and missed this op's error model on the GPU: their gates refuse the tanh form
(``backends/_serving_gates.py``).
"""

from __future__ import annotations

import torch

from ..core.hit_guard import SHAPE
from ..core.op import Bounds, Case, Op
from . import _and_mul
from . import _checks as check
from .geglu import APPROXIMATIONS, gelu
from .geglu import error_model as geglu_error_model

OP_ID = "serving.gelu_and_mul"


def reference(x: torch.Tensor, approximate: str = "none", out: torch.Tensor | None = None) -> torch.Tensor:
    """The semantics, in plain torch (fp32 math; fp64 stays fp64); writes into ``out`` if given."""
    gate, up = _and_mul.halves(x)
    acc = torch.promote_types(x.dtype, torch.float32)
    y = gelu(gate.to(acc), approximate) * up.to(acc)  # geglu's gelu: inf at +inf on every path
    return y.to(x.dtype) if out is None else out.copy_(y)


def validate(x: torch.Tensor, approximate: str = "none", out: torch.Tensor | None = None) -> None:
    _and_mul.validate_and_mul(OP_ID, x, out)
    check.choice(OP_ID, "approximate", approximate, APPROXIMATIONS)


def _key(x: torch.Tensor, approximate: str = "none", out: torch.Tensor | None = None) -> tuple:
    return _and_mul.key(x, approximate)


_op: Op  # defined below, after the public function it serves


def gelu_and_mul(x: torch.Tensor, *, approximate: str = "none", out: torch.Tensor | None = None, impl: str | None = None) -> torch.Tensor:
    """``gelu(x[..., :d], approximate) * x[..., d:]`` for x ``[..., 2d]`` (into ``out`` if given).

    >>> import torch, polykernel
    >>> x = torch.randn(4, 16)
    >>> polykernel.gelu_and_mul(x, approximate="tanh").shape
    torch.Size([4, 8])
    """
    if out is not None:  # every call: a given out's memory (the class holds the rest)
        _and_mul.check_memory(OP_ID, x, out)
    return _dispatch(impl, x, approximate, _and_mul.allocate(x, out))


# -- error model (see polykernel.core.op.ErrorModel) --------------------------------------------------
# geglu's, on the two halves (see ops/geglu.py).
def error_model(x: torch.Tensor, approximate: str = "none", out: torch.Tensor | None = None) -> Bounds:
    return geglu_error_model(*_and_mul.halves(x), approximate)


def cases(device: torch.device | str, dtype: torch.dtype, large: bool = False) -> list[Case]:
    """Awkward shapes and layouts for both approximations, sized for the CPU interpreter unless ``large``."""
    out = _and_mul.and_mul_cases(device, dtype, large)
    small = _and_mul.and_mul_cases(device, dtype, False)
    tanh = [Case(f"{c.label}-tanh", c.args, {"approximate": "tanh"}) for c in small[:6]]
    if large:
        # The full-size rows are the only ones whose half rows are multiples of 16 bytes, which the
        # peers' kernels need (their gates refuse the small ones): these are the cases that found
        # FlashInfer's and sgl-kernel's tanh kernels outside the error model (their gates now refuse
        # the tanh form).
        tanh += [Case(f"{c.label}-tanh", c.args, {"approximate": "tanh"}) for c in out[len(small) :]]
    return out + tanh


def outputs(x: torch.Tensor, *_: object) -> tuple[tuple[torch.Size, torch.dtype], ...]:
    return _and_mul.outputs(x)


_op = Op(
    OP_ID,
    fields=("device", "dtype", "needs_grad", "n", "approximate", "tokens"),
    key=_key,
    guard=(SHAPE, None, SHAPE),  # x's rows are its tokens' bucket; out's shape is part of its fit
    default_key=lambda device, dtype: (device, dtype, False, None, "none", None),
    validate=validate,
    reference=reference,
    outputs=outputs,
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
