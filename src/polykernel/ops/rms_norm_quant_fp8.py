"""``serving.rms_norm_quant_fp8``: ``q = clamp(rms_norm(x, weight, eps) / scale, ±448)`` in fp8 e4m3.

RMSNorm fused with static fp8 quantisation (vLLM's ``rms_norm_static_fp8_quant``): the normalised,
weighted x stays in fp32 (fp64 for fp64) and is rounded once, to e4m3; vLLM's kernel rounds it to
x's dtype first, and its clamp turns a NaN into +448 (here a NaN in a row makes the row's q NaN,
an inf its own q at least). The scale is fp32, one value (``()`` or ``(1,)``) or one per row
(``[..., 1]``); the weight ``[N]`` may have another floating dtype. Inference only; CUDA-graph safe.
"""

from __future__ import annotations

import torch

from ..core.hit_guard import SHAPE
from ..core.op import Bounds, Case, ErrorModel, Op, rows_and_len
from . import _checks as check
from . import _serving as serving

OP_ID = "serving.rms_norm_quant_fp8"


def reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6, q: torch.Tensor | None = None) -> torch.Tensor:
    """The semantics, in plain torch (fp32 math; fp64 stays fp64); writes into q if given, else
    returns it (unrounded for a float64 x: the exact result)."""
    acc = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(acc)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.to(acc)
    return serving.quantised(y, scale, q)


def validate(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6, q: torch.Tensor | None = None) -> None:
    check.tensor(OP_ID, "x", x)
    check.floating(OP_ID, "x", x)
    check.tensor(OP_ID, "weight", weight)
    check.floating(OP_ID, "weight", weight)
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise check.OpArgumentError(OP_ID, "weight", f"expected shape ({x.shape[-1]},) to match x's last dim, got {tuple(weight.shape)}")
    check.same_device(OP_ID, "weight", weight, "x", x)
    check.eps(OP_ID, eps)
    serving.inference_only(OP_ID, "x", x)
    serving.inference_only(OP_ID, "weight", weight)
    serving.validate_scale(OP_ID, scale, x)
    if q is not None:
        serving.destination(OP_ID, "q", q, tuple(x.shape), serving.FP8, x)


def _key(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6, *_: object, **__: object) -> tuple:
    return (x.device, x.dtype, False, x.shape[-1], weight.dtype, scale.numel() != 1, eps)


_op: Op  # defined below, after the public function it serves


def rms_norm_quant_fp8(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6, *, impl: str | None = None
) -> torch.Tensor:
    """RMS-normalise x, scale by weight, quantise to fp8 e4m3 with the given fp32 scale.

    >>> import torch, polykernel
    >>> q = polykernel.rms_norm_quant_fp8(torch.randn(4, 64), torch.ones(64), torch.tensor([0.05]))
    >>> q.dtype, tuple(q.shape)
    (torch.float8_e4m3fn, (4, 64))
    """
    return _dispatch(impl, x, weight, scale, eps, serving.fp8_like(x))


# -- error model (see polykernel.core.op.ErrorModel) --------------------------------------------------
# rms_norm's forward model in fp32 (rstd from a sum of N squares: λ·√N·u32, halved by the root; a
# few elementwise roundings), one division by the scale, then one rounding to e4m3 (u = 2^-4, or
# half its smallest subnormal, 2^-10, absolute).
def error_model(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6, q: torch.Tensor | None = None) -> Bounds:
    _, n = rows_and_len(x)
    return Bounds(outputs=(ErrorModel(rounds=1, ops=9, sum_rel=0.5, n=n, nonfinite_rows=True),))


def example(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str, requires_grad: bool = False) -> Case:
    """Random arguments of one x shape (a per-tensor scale that fits unit-RMS rows)."""
    x = torch.randn(shape, dtype=dtype, device=device)
    w = (1 + 0.1 * torch.randn(shape[-1], device=device)).to(dtype)
    return Case(f"{'x'.join(map(str, shape))}", (x, w, torch.tensor([6.0 / 448], device=device)))


def bytes_moved(x: torch.Tensor, weight: torch.Tensor, *_: object, backward: bool = False) -> int:
    """Fewest bytes: reads x and the weight once, writes q (1 byte each)."""
    return x.numel() * (x.element_size() + 1) + weight.numel() * weight.element_size()


def cases(device: torch.device | str, dtype: torch.dtype, large: bool = False) -> list[Case]:
    """Awkward shapes, weights and scales, sized for the CPU interpreter unless ``large``."""

    def t(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(shape, device=device)).to(dtype)

    def w(n: int, wdtype: torch.dtype = dtype) -> torch.Tensor:
        return (1 + 0.1 * torch.randn(n, device=device)).to(wdtype)

    def s(value: float) -> torch.Tensor:
        return torch.tensor([value], device=device)

    out = [
        Case("1x1", (t(1, 1), w(1), s(0.01))),
        Case("1x4096-decode", (t(1, 4096), w(4096), s(5.0 / 448))),
        Case("3x7", (t(3, 7), w(7), s(0.02))),
        Case("2x5x33", (t(2, 5, 33), w(33), s(0.01))),
        Case("0x16-no-tokens", (t(0, 16), w(16), s(0.01))),
        Case("6x128-saturating", (t(6, 128), w(128), s(1.0 / 448))),
        Case("4x64-fp32w-eps", (t(4, 64, scale=1e-3), w(64, torch.float32), s(0.02)), {"eps": 1e-5}),
        Case("5x96-row-scales", (t(5, 96), w(96), torch.rand(5, 1, device=device) * 0.02 + 0.004)),
        Case("9x200-rowstrided", (t(18, 200)[::2], w(200), s(0.01))),
        Case("7x64-colstrided", (t(7, 128)[:, ::2], w(128)[::2], s(0.01))),
        Case("3x20001-long", (t(3, 20001), w(20001), s(0.01))),
    ]
    if large:
        out += [
            Case("8192x4096", (t(8192, 4096), w(4096), s(0.02))),
            Case("64x8192", (t(64, 8192), w(8192), s(0.02))),
            Case("16x65536", (t(16, 65536), w(65536), s(0.02))),
        ]
    return out


def outputs(x: torch.Tensor, *_: object) -> tuple[tuple[torch.Size, torch.dtype], ...]:
    return (serving.fp8_outputs(x),)


_op = Op(
    OP_ID,
    fields=("device", "dtype", "needs_grad", "n", "weight_dtype", "per_row", "eps"),
    key=_key,
    guard=(SHAPE, SHAPE, SHAPE, None, SHAPE),
    default_key=lambda device, dtype: (device, dtype, False, None, dtype, False, 1e-6),
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
