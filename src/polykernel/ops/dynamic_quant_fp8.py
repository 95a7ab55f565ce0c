"""``serving.dynamic_quant_fp8``: ``x -> (q, scale)``, fp8 e4m3 with a scale computed from x.

``scale = max(amax / 448, 1e-12)`` in fp32, where amax is ``max |x|`` over each row
(``per_token=True``: scale ``[..., 1]``, one per token) or over the whole tensor (``[1]``);
``q = clamp(x / scale, -448, 448)`` rounded to ``float8_e4m3fn`` (nearest even), so that
``q.float() * scale`` dequantises. 448 is e4m3's largest finite value; the floor keeps an
all-zero row at zeros. Math in fp32 (fp64 stays fp64). A NaN in x makes its row's (or the
tensor's) scale and q NaN; an inf makes the scale inf, q 0 for the finite values and NaN for the
inf (inf / inf). Inference only; CUDA-graph safe (the outputs are allocated before the launches).

Where vLLM's ``scaled_fp8_quant`` (and SGLang's, which mirrors it) differ, by choice:

- the default here is per token; theirs is per tensor (``use_per_token_if_dynamic=False``);
- the floor: vLLM's per-token kernel floors the scale at ``1 / (448·512)`` (~4.4e-6), so a row
  whose amax is below 1/512 gets that scale and a coarser q (the same values dequantised, to
  within e4m3's rounding); its per-tensor kernel has no floor; SGLang's per-token scale is 0 for
  an all-zero row. Here it is 1e-12 throughout;
- no ``scale_ub`` (vLLM clamps each row's amax to it before dividing);
- non-finite input: their CUDA kernels take amax with ``fmaxf`` (a NaN is skipped) and clamp with
  ``fminf``/``fmaxf``, which turn a NaN into +448: a NaN activation comes out finite there;
- they multiply by ``1/scale`` (one more rounding, inside e4m3's); q is ``float8_e4m3fn`` only
  (vLLM on ROCm: ``e4m3fnuz`` with max 224).
"""

from __future__ import annotations

import torch

from ..core.hit_guard import SHAPE
from ..core.op import Bounds, Case, ErrorModel, Op
from . import _checks as check
from . import _serving as serving

OP_ID = "serving.dynamic_quant_fp8"


def _amax(xf: torch.Tensor, per_token: bool) -> torch.Tensor:
    """max |x| per row ([..., 1]) or over x ([1]); 0 over nothing."""
    shape = (*xf.shape[:-1], 1) if per_token else (1,)
    if xf.shape[-1] == 0 or xf.numel() == 0:
        return torch.zeros(shape, dtype=xf.dtype, device=xf.device)
    a = xf.abs()
    return a.amax(-1, keepdim=True) if per_token else a.amax().reshape(1)


def reference(
    x: torch.Tensor, per_token: bool = True, q: torch.Tensor | None = None, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The semantics, in plain torch (fp32 math; fp64 stays fp64); writes into q and scale if
    given, else returns them (unrounded, and a float64 scale, for a float64 x: the exact result)."""
    acc = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(acc)
    s = (_amax(xf, per_token) / serving.FP8_MAX).clamp(min=serving.SCALE_FLOOR)  # clamp keeps NaN
    if scale is not None:
        s = scale.copy_(s)
    elif acc != torch.float64:
        s = s.to(torch.float32)
    return serving.quantised(xf, s, q), s


def validate(x: torch.Tensor, per_token: bool = True, q: torch.Tensor | None = None, scale: torch.Tensor | None = None) -> None:
    check.tensor(OP_ID, "x", x)
    check.floating(OP_ID, "x", x)
    check.boolean(OP_ID, "per_token", per_token)
    serving.inference_only(OP_ID, "x", x)
    if q is not None:
        serving.destination(OP_ID, "q", q, tuple(x.shape), serving.FP8, x)
    if scale is not None:
        serving.destination(OP_ID, "scale", scale, (*x.shape[:-1], 1) if per_token else (1,), torch.float32, x)


def _key(x: torch.Tensor, per_token: bool = True, *_: object, **__: object) -> tuple:
    return (x.device, x.dtype, False, x.shape[-1], per_token)


_op: Op  # defined below, after the public function it serves


def dynamic_quant_fp8(x: torch.Tensor, *, per_token: bool = True, impl: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise x to fp8 e4m3 with a scale per token (``[..., 1]``) or per tensor (``[1]``).

    >>> import torch, polykernel
    >>> x = torch.randn(4, 64)
    >>> q, scale = polykernel.dynamic_quant_fp8(x)
    >>> q.dtype, tuple(scale.shape)
    (torch.float8_e4m3fn, (4, 1))
    >>> bool(((q.float() * scale - x).abs() <= x.abs() / 16 + 1e-3).all())
    True
    """
    q = serving.fp8_like(x)
    scale = None if q is None else x.new_empty((*x.shape[:-1], 1) if per_token is True else (1,), dtype=torch.float32)
    return _dispatch(impl, x, per_token, q, scale)


# -- error model (see polykernel.core.op.ErrorModel) --------------------------------------------------
# scale: the exact amax (a max rounds nothing) divided by 448 and rounded to fp32 once. q: x / scale
# in fp32 (one rounding, plus the computed scale's own, relative) rounded to e4m3 once: within
# u(e4m3) = 2^-4 of the exact quotient relatively, or half e4m3's smallest subnormal (2^-10) below
# its normal range. The comparison is with the exact (float64) x / exact scale, not a rounded q, so
# a quotient that lands on either side of an e4m3 rounding boundary is no false alarm.
def error_model(x: torch.Tensor, per_token: bool = True, q: torch.Tensor | None = None, scale: torch.Tensor | None = None) -> Bounds:
    return Bounds(outputs=(ErrorModel(rounds=1, ops=4), ErrorModel(rounds=1, ops=1)))


def example(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str, requires_grad: bool = False) -> Case:
    """Random activations of one shape (benchmarks, ``explain --shape``, the demo)."""
    return Case(f"{'x'.join(map(str, shape))}", (torch.randn(shape, dtype=dtype, device=device),))


def bytes_moved(x: torch.Tensor, per_token: bool = True, *_: object, backward: bool = False) -> int:
    """Fewest bytes: reads x once, writes q (1 byte each) and the fp32 scales: one per row, or
    one per tensor (``per_token=False``)."""
    scales = max(1, x.numel() // max(x.shape[-1], 1)) if per_token else 1
    return x.numel() * (x.element_size() + 1) + 4 * scales


def quant_inputs(device: torch.device | str, dtype: torch.dtype, large: bool) -> list[tuple[str, torch.Tensor]]:
    """Labelled activations for the quantisation ops' cases (shared with static_quant_fp8)."""

    def t(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(shape, device=device)).to(dtype)

    zeros_row = t(3, 40)
    zeros_row[1] = 0  # an all-zero token: the scale floor
    tiny = t(4, 64, scale=1e-3)  # e4m3 subnormals
    out = [
        ("1x1", t(1, 1)),
        ("1x4096-decode", t(1, 4096)),
        ("5x33", t(5, 33)),
        ("2x3x40", t(2, 3, 40)),
        ("0x16-no-tokens", t(0, 16)),
        ("3x40-zero-row", zeros_row),
        ("4x64-tiny", tiny),
        ("6x100-wide-range", t(6, 100, scale=300.0)),
        ("8x200-rowstrided", t(8, 300)[:, 50:250]),
        ("5x48-colstrided", t(5, 96)[:, ::2]),
        ("2x20001-long", t(2, 20001)),
    ]
    if large:
        out += [("8192x4096", t(8192, 4096)), ("64x14336", t(64, 14336)), ("16x65536", t(16, 65536))]
    return out


def cases(device: torch.device | str, dtype: torch.dtype, large: bool = False) -> list[Case]:
    """Awkward shapes and values, per token and per tensor, sized for the CPU interpreter unless ``large``."""
    out = []
    for label, x in quant_inputs(device, dtype, large):
        out.append(Case(f"{label}-token", (x,)))
        out.append(Case(f"{label}-tensor", (x.clone(),), {"per_token": False}))
    return out


def outputs(x: torch.Tensor, per_token: bool = True, *_: object) -> tuple[tuple[torch.Size, torch.dtype], ...]:
    """q's and scale's shapes and dtypes, without running anything."""
    return (serving.fp8_outputs(x), (torch.Size((*x.shape[:-1], 1) if per_token else (1,)), torch.float32))


_op = Op(
    OP_ID,
    fields=("device", "dtype", "needs_grad", "n", "per_token"),
    key=_key,
    guard=(SHAPE, None, SHAPE, SHAPE),
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
    writes=("q", "scale"),
    validate_each_call=True,
)
_dispatch = _op.dispatch
