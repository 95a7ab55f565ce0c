"""``norm.group_norm``: ``torch.nn.functional.group_norm``.

x is ``[N, C, *]`` (at least 2 dims); its C channels form ``num_groups`` groups of ``C /
num_groups`` consecutive channels, and each (sample, group) is normalized over its channels and
all their positions: ``(x - mean) / sqrt(var + eps)`` (biased variance), then scaled by
``weight[c]`` and shifted by ``bias[c]`` per channel (each optional: None means 1 and 0). The
statistics and the affine step are computed in fp32 (fp64 stays fp64) and cast once to
``x.dtype``; the weight and bias may have another floating dtype than x (fp32 parameters with
bf16 activations), and their gradients come back in their own dtypes. A group whose values are
all equal (a single value, say) normalizes to 0: the output is the bias there (PyTorch's
``F.group_norm`` refuses inputs with N·C/G·S = 1 value per group and sample in all).
"""

from __future__ import annotations

import math

import torch

from ..core.hit_guard import SHAPE, dims
from ..core.op import SUM_LAMBDA, Bounds, Case, ErrorModel, Op
from ..distributed.layout import Layout, rows_with
from . import _checks as check

OP_ID = "norm.group_norm"


def reference(
    x: torch.Tensor, num_groups: int, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None, eps: float = 1e-5
) -> torch.Tensor:
    """The semantics, in plain torch (fp32 math; fp64 stays fp64)."""
    acc = torch.promote_types(x.dtype, torch.float32)
    n, c = x.shape[0], x.shape[1]
    xg = x.to(acc).reshape(n, num_groups, c // num_groups * math.prod(x.shape[2:]))  # (sample, group) rows
    xc = xg - xg.mean(-1, keepdim=True)
    y = (xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)).reshape(x.shape)
    per_channel = (1, c) + (1,) * (x.dim() - 2)
    if weight is not None:
        y = y * weight.to(acc).reshape(per_channel)
    if bias is not None:
        y = y + bias.to(acc).reshape(per_channel)
    return y.to(x.dtype)


def _param(x: torch.Tensor, name: str, p: torch.Tensor | None) -> None:
    if p is None:
        return
    check.tensor(OP_ID, name, p)
    check.floating(OP_ID, name, p)
    if p.dim() != 1 or p.shape[0] != x.shape[1]:
        raise check.OpArgumentError(OP_ID, name, f"expected shape ({x.shape[1]},) to match x's channels (dim 1), got {tuple(p.shape)}")
    check.same_device(OP_ID, name, p, "x", x)


def validate(x: torch.Tensor, num_groups: int, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float) -> None:
    check.tensor(OP_ID, "x", x, min_dim=2)
    check.floating(OP_ID, "x", x)
    if isinstance(num_groups, bool) or not isinstance(num_groups, int):
        raise check.OpTypeError(OP_ID, "num_groups", f"expected an int, got {type(num_groups).__name__}")
    if num_groups <= 0:
        raise check.OpArgumentError(OP_ID, "num_groups", f"expected a positive number of groups, got {num_groups}")
    if x.shape[1] % num_groups:
        raise check.OpArgumentError(OP_ID, "num_groups", f"{num_groups} groups do not divide x's {x.shape[1]} channels (dim 1)")
    _param(x, "weight", weight)
    _param(x, "bias", bias)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise check.OpArgumentError(OP_ID, "eps", f"expected a number >= 0, got {check.shown(eps)}")


_grad_enabled = torch.is_grad_enabled


def _param_class(p: torch.Tensor | None) -> tuple | None:
    return None if p is None else (p.dtype, p.shape, p.device)


def _key(
    x: torch.Tensor, num_groups: int, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None, eps: float = 1e-5
) -> tuple:
    """The argument class. It holds everything validity depends on (x's dims and channels, the
    groups, the parameters' classes), so `validate` runs once per class (on the memo miss). The
    guard (``_op``'s ``guard``) recognises a repeat of it without building it: of x it pins the
    channels (dim 1; the batch and positions stay free) and the parameters' whole shapes."""
    needs_grad = (
        x.requires_grad or (weight is not None and weight.requires_grad) or (bias is not None and bias.requires_grad)
    ) and _grad_enabled()
    return (x.device, x.dtype, needs_grad, x.shape[1], x.dim(), num_groups, _param_class(weight), _param_class(bias), eps)


_op: Op  # defined below, after the public function it serves (with _dispatch, its dispatch)


def group_norm(
    x: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    impl: str | None = None,
) -> torch.Tensor:
    """Group-normalize ``x [N, C, *]`` over each group of ``C / num_groups`` channels, then scale
    by ``weight`` and shift by ``bias`` per channel (``torch.nn.functional.group_norm``).

    >>> import torch, polykernel
    >>> x = torch.randn(2, 6, 5)
    >>> polykernel.group_norm(x, 3, torch.ones(6), torch.zeros(6)).shape
    torch.Size([2, 6, 5])
    >>> y = polykernel.group_norm(x, 2, impl="torch")  # no affine parameters, forced impl
    """
    return _dispatch(impl, x, num_groups, weight, bias, eps)  # _op.dispatch; the class and validation: see _key


# -- error model (see polykernel.core.op.ErrorModel) --------------------------------------------------
# layer_norm's model over each group's L = (C/G)·S elements (S: the positions per channel): y =
# (x - μ)·rstd·w + b in fp32, rounded once; μ sums L terms of size up to max |x|, so x̂ is off by up
# to (λ·√L + 2)·u32·k with k = max |x|·rstd (the data's offset in units of its spread); dx =
# rstd·(g - mean(g) - x̂·mean(g·x̂)) cancels: relative to its terms' magnitude rstd·max|w|·k. dW and
# dB sum each channel's N·S terms (random signs): relative to √(N·S)·k.
def _spread(x: torch.Tensor, num_groups: int, eps: float) -> tuple[float, float]:
    """(k, max rstd): k = max(1, max |x|·rstd) over the groups."""
    if not x.numel():
        return 0.0, 0.0
    xd = x.detach().double().reshape(x.shape[0], num_groups, -1)
    rstd = torch.rsqrt(xd.var(-1, unbiased=False, keepdim=True) + eps)
    return max(1.0, (xd.abs() * rstd).max().item()), rstd.max().item()


def error_model(
    x: torch.Tensor, num_groups: int, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None, eps: float = 1e-5
) -> Bounds:
    n, c = x.shape[0], x.shape[1]
    positions = math.prod(x.shape[2:])
    group = c // num_groups * positions
    k, rstd_max = _spread(x, num_groups, eps)
    w_max = weight.detach().abs().max().item() if weight is not None and weight.numel() else 1.0
    y = ErrorModel(ops=6, sum_rel=0.5, cancel=2 * k, sum_abs=k, n=group, scale=k * w_max)
    dx = ErrorModel(ops=4, sum_rel=0.5, cancel=8 + 2 * k, sum_abs=1 + k, n=group, scale=rstd_max * w_max * k)
    per_channel = n * positions  # the terms of each dW, dB
    dwb = ErrorModel(ops=4, cancel=2 * SUM_LAMBDA, sum_abs=1 + SUM_LAMBDA, n=max(group, per_channel), scale=max(per_channel, 1) ** 0.5 * k)
    return Bounds(outputs=(y,), grads={0: dx, 2: dwb, 3: dwb})


def example(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str, requires_grad: bool = False) -> Case:
    """Random arguments of a given x shape ``[N, C, *]``, 32 groups where C allows (else one
    group per channel): benchmarks, ``explain --shape``, the demo."""
    c = shape[1]
    groups = 32 if c % 32 == 0 else c
    x = torch.randn(shape, dtype=dtype, device=device, requires_grad=requires_grad)
    w = (1 + 0.1 * torch.randn(c, device=device)).to(dtype).requires_grad_(requires_grad)
    b = (0.1 * torch.randn(c, device=device)).to(dtype).requires_grad_(requires_grad)
    return Case(f"{'x'.join(map(str, shape))},g{groups}", (x, groups, w, b))


def bytes_moved(
    x: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *_: object,
    backward: bool = False,
) -> int:
    """Fewest bytes: forward reads x and writes y; backward adds x, dy read and dx written."""
    n = x.numel() * x.element_size()
    params = sum(p.numel() * p.element_size() for p in (weight, bias) if p is not None)
    return (5 if backward else 2) * n + params * (3 if backward else 1)


def cases(device: torch.device | str, dtype: torch.dtype, large: bool = False) -> list[Case]:
    """Awkward shapes and every option, sized for the CPU interpreter unless ``large``."""

    def t(*shape: int, shift: float = 0.0) -> torch.Tensor:
        return (torch.randn(shape, device=device) + shift).to(dtype).requires_grad_()

    def w(n: int, pdtype: torch.dtype = dtype) -> torch.Tensor:
        return (1 + 0.1 * torch.randn(n, device=device)).to(pdtype).requires_grad_()

    def b(n: int, pdtype: torch.dtype = dtype) -> torch.Tensor:
        return (0.1 * torch.randn(n, device=device)).to(pdtype).requires_grad_()

    out = [
        Case("1x1-g1", (t(1, 1), 1, w(1), b(1))),
        Case("3x6-g3-2d", (t(3, 6), 3, w(6), b(6))),
        Case("2x6x5-g2", (t(2, 6, 5), 2, w(6), b(6))),
        Case("2x9x7x3-g3", (t(2, 9, 7, 3), 3, w(9), b(9))),
        Case("3x4x33-g4-per-channel", (t(3, 4, 33), 4, w(4), b(4))),
        Case("1x12x1-g1-one-group", (t(1, 12, 1), 1, w(12), b(12))),
        Case("0x4x3-g2", (t(0, 4, 3), 2, w(4), b(4))),
        Case("2x4x0-g2", (t(2, 4, 0), 2, w(4), b(4))),
        Case("2x6x10-g3-no-affine", (t(2, 6, 10), 3, None, None), {"eps": 1e-6}),
        Case("3x8x9-g4-weight-only", (t(3, 8, 9), 4, w(8), None)),
        Case("2x8x9-g2-bias-only", (t(2, 8, 9), 2, None, b(8))),
        Case("2x8x16-g4-fp32-params", (t(2, 8, 16), 4, w(8, torch.float32), b(8, torch.float32))),
        Case("4x6x50-g3-shifted", (t(4, 6, 50, shift=40.0), 3, w(6), b(6))),  # mean >> std: variance must not cancel
        Case("3x6x20-g2-batchstrided", (t(6, 6, 20)[::2], 2, w(6), b(6))),
        Case("2x6x5x4-g3-channels-last", (t(2, 5, 4, 6).permute(0, 3, 1, 2), 3, w(6), b(6))),
        Case("2x4x9000-g2-long", (t(2, 4, 9000), 2, w(4), b(4))),  # groups of 18000: chunked
        Case("2x48x700-g2-long-shifted-channel-tiles", (t(2, 48, 700, shift=40.0), 2, w(48), None)),  # chunked: 6 tiles of 4 channels
    ]
    if large:
        out += [
            Case("8x512x64x64-g32", (t(8, 512, 64, 64), 32, w(512), b(512))),
            Case("16x320x32x32-g32-fp32-params", (t(16, 320, 32, 32), 32, w(320, torch.float32), b(320, torch.float32))),
            Case("4x128x128x128-g32", (t(4, 128, 128, 128), 32, w(128), b(128))),
            Case("2x1280x16x16-g32", (t(2, 1280, 16, 16), 32, w(1280), b(1280))),
            Case("8192x4096-g32-2d", (t(8192, 4096), 32, w(4096), b(4096))),
            Case("3x7x100003-g7-odd", (t(3, 7, 100003), 7, w(7), None)),
        ]
    return out


def outputs(x: torch.Tensor, *_: object) -> tuple[tuple[torch.Size, torch.dtype], ...]:
    """The reference's output shape and dtype, without running it (the first-call check)."""
    return ((x.shape, x.dtype),)


_op = Op(
    OP_ID,
    fields=("device", "dtype", "needs_grad", "channels", "ndim", "num_groups", "weight", "bias", "eps"),
    key=_key,
    guard=(dims(1), None, SHAPE, SHAPE, None),
    # the parameters' class of unknown shape: present, in x's dtype (the common call; None would say "absent")
    default_key=lambda device, dtype: (device, dtype, False, None, None, 1, (dtype, None, device), (dtype, None, device), 1e-5),
    validate=validate,
    reference=reference,
    outputs=outputs,
    error_model=error_model,
    dtypes=(torch.float32, torch.bfloat16, torch.float16),
    cases=cases,
    example=example,
    bytes_moved=bytes_moved,
    # impls: none here, each backend registers its own (its manifest.py: polykernel.backends)
    # DTensor: samples are independent, a group spans channels and positions: only dim 0 may be
    # sharded (weight and bias replicated; their gradients come back partial)
    dtensor_layout=Layout((0,), rows_with(), (0,)),
)
_dispatch = _op.dispatch  # bound once: ~30 ns less per call than the attribute lookup
