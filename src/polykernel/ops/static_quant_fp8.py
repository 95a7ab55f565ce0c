"""``serving.static_quant_fp8``: ``q = clamp(x / scale, -448, 448)`` in ``float8_e4m3fn``.

The scale is given (calibrated, or from ``dynamic_quant_fp8``): fp32, one value (shape ``()`` or
``(1,)``) or one per row (``[..., 1]``). Math in fp32 (fp64 stays fp64), one rounding to e4m3
(nearest even). Scale values are not checked (that would need a device sync on CUDA): a zero
scale gives ±448 and NaN like the division does. A NaN in x stays NaN in q, where vLLM's
``static_scaled_fp8_quant`` clamps it to +448 (``fminf``); ±inf saturates to ±448 in both. Per-row
scales are ours (vLLM's static kernel takes one). Inference only; CUDA-graph safe.
"""

from __future__ import annotations

import torch

from ..core.hit_guard import SHAPE
from ..core.op import Bounds, Case, ErrorModel, Op
from . import _checks as check
from . import _serving as serving
from .dynamic_quant_fp8 import quant_inputs

OP_ID = "serving.static_quant_fp8"


def reference(x: torch.Tensor, scale: torch.Tensor, q: torch.Tensor | None = None) -> torch.Tensor:
    """The semantics, in plain torch (fp32 math; fp64 stays fp64); writes into q if given, else
    returns it (unrounded for a float64 x: the exact result)."""
    return serving.quantised(x.to(torch.promote_types(x.dtype, torch.float32)), scale, q)


def validate(x: torch.Tensor, scale: torch.Tensor, q: torch.Tensor | None = None) -> None:
    check.tensor(OP_ID, "x", x)
    check.floating(OP_ID, "x", x)
    serving.inference_only(OP_ID, "x", x)
    serving.validate_scale(OP_ID, scale, x)
    if q is not None:
        serving.destination(OP_ID, "q", q, tuple(x.shape), serving.FP8, x)


def _key(x: torch.Tensor, scale: torch.Tensor, *_: object, **__: object) -> tuple:
    return (x.device, x.dtype, False, x.shape[-1], scale.numel() != 1)


_op: Op  # defined below, after the public function it serves


def static_quant_fp8(x: torch.Tensor, scale: torch.Tensor, *, impl: str | None = None) -> torch.Tensor:
    """Quantise x to fp8 e4m3 with a given fp32 scale (per tensor, or per row ``[..., 1]``).

    >>> import torch, polykernel
    >>> q = polykernel.static_quant_fp8(torch.tensor([[1.0, -3.0, 900.0]]), torch.tensor([0.5]))
    >>> q.float().tolist()
    [[2.0, -6.0, 448.0]]
    """
    return _dispatch(impl, x, scale, serving.fp8_like(x))


# -- error model (see polykernel.core.op.ErrorModel) --------------------------------------------------
# x / scale in fp32 (one rounding) rounded to e4m3 once: u(e4m3) = 2^-4 relative to the exact
# quotient, or half the smallest e4m3 subnormal (2^-10) absolute below its normal range.
def error_model(x: torch.Tensor, scale: torch.Tensor, q: torch.Tensor | None = None) -> Bounds:
    return Bounds(outputs=(ErrorModel(rounds=1, ops=2),))


def example(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str, requires_grad: bool = False) -> Case:
    """Random activations of one shape and a per-tensor scale."""
    x = torch.randn(shape, dtype=dtype, device=device)
    return Case(f"{'x'.join(map(str, shape))}", (x, torch.tensor([4.0 / 448], device=device)))


def bytes_moved(x: torch.Tensor, *_: object, backward: bool = False) -> int:
    """Fewest bytes: reads x once, writes q (1 byte each)."""
    return x.numel() * (x.element_size() + 1)


def cases(device: torch.device | str, dtype: torch.dtype, large: bool = False) -> list[Case]:
    """Per-tensor scales (some that saturate) and per-row ones, sized for the CPU interpreter unless ``large``."""
    out = []
    for i, (label, x) in enumerate(quant_inputs(device, dtype, large)):
        amax = x.detach().float().abs().amax().item() if x.numel() else 1.0
        tensor_scale = torch.tensor([max(amax, 1e-3) / (448.0 if i % 2 else 1000.0)], device=device)  # odd: fits; even: saturates
        out.append(Case(f"{label}-tensor", (x, tensor_scale)))
        if x.dim() >= 2:
            rows = (
                (x.detach().float().abs().amax(-1, keepdim=True) / 448.0).clamp(min=1e-6) if x.shape[-1] else torch.ones(*x.shape[:-1], 1)
            )
            out.append(Case(f"{label}-row", (x.clone(), rows.to(device))))
    x = quant_inputs(device, dtype, False)[2][1]
    out.append(Case("5x33-0d-scale", (x, torch.tensor(0.01, device=device))))
    return out


def outputs(x: torch.Tensor, *_: object) -> tuple[tuple[torch.Size, torch.dtype], ...]:
    return (serving.fp8_outputs(x),)


_op = Op(
    OP_ID,
    fields=("device", "dtype", "needs_grad", "n", "per_row"),
    key=_key,
    guard=(SHAPE, SHAPE, SHAPE),
    default_key=lambda device, dtype: (device, dtype, False, None, False),
    validate=validate,
    reference=reference,
    outputs=outputs,
    error_model=error_model,
    dtypes=(torch.float32, torch.bfloat16, torch.float16),
    cases=cases,
    example=example,
    bytes_moved=bytes_moved,
    # impls: none here, each backend registers its own (its manifest.py: polykernel.backends)
    writes=("q",),
    validate_each_call=True,
)
_dispatch = _op.dispatch
