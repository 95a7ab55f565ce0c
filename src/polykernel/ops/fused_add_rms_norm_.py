"""``serving.fused_add_rms_norm_``: in place, ``residual <- x + residual``, ``x <- rms_norm(residual)``.

vLLM's ``fused_add_rms_norm(input, residual, weight, eps)``: the pre-norm step of a decoder
layer, writing both results over its inputs; returns ``(x, residual)`` (the same tensors). The
math is ``norm.fused_add_rms_norm``'s: the sum rounded to x's dtype as PyTorch's ``x + residual``
rounds it, then ``rms_norm`` with ``casting="fp32"`` on that rounded sum (``offset=1.0`` is
Gemma's ``1 + w``). vLLM's kernel rounds the normalised x to x's dtype before the weight multiply
(``casting="llama"``); ours rounds once, at the end. x and residual have one shape, dtype and
device and share no memory; the weight may have another floating dtype. Every argument is
checked before anything is written. Inference only; CUDA-graph safe (no allocation).
"""

from __future__ import annotations

import torch

from ..core.hit_guard import LAST, SHAPE
from ..core.op import Bounds, Case, ErrorModel, Op, rows_and_len
from . import _serving as serving
from . import fused_add_rms_norm as fused
from .fused_add_rms_norm import reference as fused_reference

OP_ID = "serving.fused_add_rms_norm_"


def reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, offset: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The semantics, in plain torch: norm.fused_add_rms_norm's results, written over the inputs."""
    y, s = fused_reference(x, residual, weight, eps, offset)
    residual.copy_(s)
    x.copy_(y)
    return x, residual


def validate(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, offset: float = 0.0) -> None:
    fused.check_arguments(OP_ID, x, residual, weight, eps, offset)
    for name, t in (("x", x), ("residual", residual), ("weight", weight)):
        serving.inference_only(OP_ID, name, t)
    check_memory(x, residual, weight)


def check_memory(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> None:
    """What validity reads of memory (strides, addresses), on every call before anything is
    written: the guard recognises a repeat by metadata and options only."""
    if not (isinstance(x, torch.Tensor) and isinstance(residual, torch.Tensor) and isinstance(weight, torch.Tensor)):
        return  # validate names it
    serving.written(OP_ID, "x", x)
    serving.written(OP_ID, "residual", residual)
    serving.no_overlap(OP_ID, "residual", residual, "x", x)
    # a weight inside x or residual would be read by one row after another row wrote it
    serving.no_overlap(OP_ID, "weight", weight, "x", x)
    serving.no_overlap(OP_ID, "weight", weight, "residual", residual)


def _key(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, offset: float = 0.0) -> tuple:
    return (x.device, x.dtype, False, x.shape[-1], weight.dtype, eps, offset)


_op: Op  # defined below, after the public function it serves


def fused_add_rms_norm_(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    offset: float = 0.0,
    impl: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: ``residual <- x + residual``, ``x <- rms_norm(residual, weight, eps)``; returns ``(x, residual)``.

    >>> import torch, polykernel
    >>> x, r, w = torch.randn(4, 8), torch.randn(4, 8), torch.ones(8)
    >>> s = x + r
    >>> y, r2 = polykernel.fused_add_rms_norm_(x, r, w)
    >>> y is x and r2 is r and torch.equal(r, s)
    True
    """
    if not serving.compiling():  # every call, before anything is written (compiled: the custom op checks)
        check_memory(x, residual, weight)
    return _dispatch(impl, x, residual, weight, eps, offset)


# -- error model (see polykernel.core.op.ErrorModel) --------------------------------------------------
# norm.fused_add_rms_norm's forward: s one fp32 sum rounded once; y rms_norm's model on the rounded
# s, with one more rounding (the semantics normalise the rounded s, the exact result the exact one).
def error_model(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, offset: float = 0.0) -> Bounds:
    _, n = rows_and_len(x)
    y = ErrorModel(rounds=2, ops=8, sum_rel=0.5, n=n, nonfinite_rows=True)
    return Bounds(outputs=(y, ErrorModel(ops=1)))


def example(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str, requires_grad: bool = False) -> Case:
    """Random arguments of a given x shape (benchmarks, ``explain --shape``, the demo)."""
    x = torch.randn(shape, dtype=dtype, device=device)
    r = torch.randn(shape, dtype=dtype, device=device)
    w = (1 + 0.1 * torch.randn(shape[-1], device=device)).to(dtype)
    return Case(f"{'x'.join(map(str, shape))}", (x, r, w))


def bytes_moved(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, *_: object, backward: bool = False) -> int:
    """Fewest bytes: reads x and residual, writes both (4·M·N), reads the weight once."""
    return 4 * x.numel() * x.element_size() + weight.numel() * weight.element_size()


def cases(device: torch.device | str, dtype: torch.dtype, large: bool = False) -> list[Case]:
    """Awkward shapes, layouts and options, sized for the CPU interpreter unless ``large``."""

    def t(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(shape, device=device)).to(dtype)

    def w(n: int, wdtype: torch.dtype = dtype) -> torch.Tensor:
        return (1 + 0.1 * torch.randn(n, device=device)).to(wdtype)

    out = [
        Case("1x1", (t(1, 1), t(1, 1), w(1))),
        Case("1x4096-decode", (t(1, 4096), t(1, 4096), w(4096))),
        Case("3x7", (t(3, 7), t(3, 7), w(7))),
        Case("2x5x33", (t(2, 5, 33), t(2, 5, 33), w(33))),
        Case("0x16-no-tokens", (t(0, 16), t(0, 16), w(16))),
        Case("6x128-big-residual", (t(6, 128, scale=0.05), t(6, 128, scale=20.0), w(128))),
        Case("5x96-gemma", (t(5, 96), t(5, 96), w(96)), {"offset": 1.0, "eps": 1e-5}),
        Case("4x64-fp32w", (t(4, 64), t(4, 64), w(64, torch.float32))),
        # rows of larger buffers: written in place through their own row strides
        Case("9x200-rowstrided", (t(18, 200)[::2], t(9, 300)[:, 50:250], w(200))),
        Case("7x64-colstrided", (t(7, 64), t(7, 128)[:, ::2], w(128)[::2])),
        Case("6x48-transposed", (t(48, 6).t(), t(6, 48), w(48))),
        Case("3x20001-long", (t(3, 20001), t(3, 20001), w(20001))),  # the chunked walk, in place
    ]
    if large:
        out += [
            Case("8192x4096", (t(8192, 4096), t(8192, 4096), w(4096))),
            Case("64x8192", (t(64, 8192), t(64, 8192), w(8192))),
            Case("32x65536", (t(32, 65536), t(32, 65536), w(65536))),
        ]
    return out


def outputs(x: torch.Tensor, residual: torch.Tensor, *_: object) -> tuple[tuple[torch.Size, torch.dtype], ...]:
    """The outputs' shapes and dtypes (those of x and residual), without running anything."""
    return ((x.shape, x.dtype), (residual.shape, residual.dtype))


_op = Op(
    OP_ID,
    fields=("device", "dtype", "needs_grad", "n", "weight_dtype", "eps", "offset"),
    key=_key,
    guard=(LAST, 0, SHAPE, None, None),  # residual has x's shape (validate); the rows are free
    default_key=lambda device, dtype: (device, dtype, False, None, dtype, 1e-6, 0.0),
    validate=validate,
    reference=reference,
    outputs=outputs,
    error_model=error_model,
    dtypes=(torch.float32, torch.bfloat16, torch.float16),
    cases=cases,
    example=example,
    bytes_moved=bytes_moved,
    # impls: none here, each backend registers its own (its manifest.py: polykernel.backends)
    writes=("x", "residual"),
    validate_each_call=True,
)
_dispatch = _op.dispatch
