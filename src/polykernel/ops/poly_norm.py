"""``norm.poly_norm``: ``w0·norm(x³) + w1·norm(x²) + w2·norm(x) + b`` over the last dim (PolyCom,
Zhuo et al., 2024), with ``norm(u) = u / sqrt(mean(u², -1) + eps)`` (RMS normalisation).

``weight`` has 3 elements (``[w0, w1, w2]``), ``bias`` is one number (a 0-dim or 1-element
``[1]`` tensor); both learnable, in any floating dtype (their gradients come back in their own
dtypes and shapes). Math in fp32 (fp64 stays fp64), cast once to x's dtype. Backward, with
``r_p = rsqrt(mean(x^2p) + eps)``, ``n_p = x^p·r_p`` and ``g = dy``: ``dw_p = Σ g·n_p`` and
``db = Σ g`` over every element; ``dx = Σ_p p·x^(p-1)·r_p·(w_p·g - n_p·mean(w_p·g·n_p))``.
The norms are scale-invariant, and every impl of ours computes them on x scaled per row by a power
of two (`scaled`), so that x⁶ neither overflows fp32 (|x| > 2.6e6) nor underflows (eps = 0).
"""

from __future__ import annotations

import math

import torch

from ..core.hit_guard import LAST, SHAPE
from ..core.op import SUM_LAMBDA, Bounds, Case, ErrorModel, Op, rows_and_len
from ..distributed.layout import ROWS, Layout, rows_with
from . import _checks as check

OP_ID = "norm.poly_norm"


def eps_exponent(eps: float) -> int:
    """The least exponent e of the row scale ``2^e`` (see `scaled`): ``eps·2^(-6e) <= 1``, so that
    ``eps·s^(-2p)`` cannot overflow (eps = 0 adds 0 at any scale, so it bounds nothing)."""
    return math.ceil(math.frexp(eps)[1] / 6) if eps > 0 else -(1 << 14)


def scaled(xf: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """``(v, 1/s, (eps·s⁻⁶, eps·s⁻⁴, eps·s⁻²))`` with ``v = x/s`` per row, ``s = 2^e`` the power of two
    at or below ``max|x|`` (at least ``2^eps_exponent(eps)``; s and 1/s normal numbers of xf's dtype).

    The norm is scale-invariant: ``n_p = v^p·rsqrt(mean(v^2p) + eps·s^-2p)`` is ``x^p·rsqrt(mean(x^2p)
    + eps)``, but ``x⁶`` overflows fp32 from ``|x| > 2.6e6`` and underflows below 1e-7 (eps = 0: 0/0).
    Scaling by a power of two is exact, so where nothing over- or underflows the result is the
    unscaled formula's to the bit. The scale is a constant (detached): it cancels from the math."""
    lo = math.log2(torch.finfo(xf.dtype).tiny)  # -126 (fp32), -1022 (fp64)
    xd = xf.detach()
    amax = xd.abs().amax(-1, keepdim=True) if xd.shape[-1] else xd.new_zeros((*xd.shape[:-1], 1))
    e = torch.log2(amax).floor_().clamp_(min(max(lo, eps_exponent(eps)), -lo), -lo)  # NaN rows stay NaN
    inv = torch.exp2(-e)
    t1 = eps * inv * inv  # one factor at a time: inv² alone may overflow where eps·inv² does not
    t2 = t1 * inv * inv
    return xf * inv, inv, (t2 * inv * inv, t2, t1)


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """The semantics, in plain torch (fp32 math; fp64 stays fp64), on x scaled per row (`scaled`)."""
    acc = torch.promote_types(x.dtype, torch.float32)
    w = weight.to(acc)
    v, _, tails = scaled(x.to(acc), eps)
    n = [u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + t) for u, t in zip((v.pow(3), v.pow(2), v), tails)]
    y = w[0] * n[0] + w[1] * n[1] + w[2] * n[2] + bias.to(acc).reshape(())
    return y.to(x.dtype)


def validate(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> None:
    check.tensor(OP_ID, "x", x)
    check.floating(OP_ID, "x", x)
    check.tensor(OP_ID, "weight", weight)
    check.floating(OP_ID, "weight", weight)
    if weight.shape != (3,):
        raise check.OpArgumentError(OP_ID, "weight", f"expected 3 elements, shape (3,) ([w0, w1, w2]), got shape {tuple(weight.shape)}")
    check.same_device(OP_ID, "weight", weight, "x", x)
    check.tensor(OP_ID, "bias", bias, min_dim=0)
    check.floating(OP_ID, "bias", bias)
    if bias.shape not in ((), (1,)):
        raise check.OpArgumentError(OP_ID, "bias", f"expected a 0-dim or 1-element ([1]) tensor, got shape {tuple(bias.shape)}")
    check.same_device(OP_ID, "bias", bias, "x", x)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise check.OpArgumentError(OP_ID, "eps", f"expected a number >= 0, got {check.shown(eps)}")


_grad_enabled = torch.is_grad_enabled


def _key(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-6) -> tuple:
    """The argument class. It holds everything validity depends on, so `validate` runs once per
    class (on the memo miss), not per call. The guard (``_op``'s ``guard``) recognises a repeat
    of it without building it: x's last dim and the parameters' whole shapes."""
    needs_grad = (x.requires_grad or weight.requires_grad or bias.requires_grad) and _grad_enabled()
    return (
        x.device,
        x.dtype,
        needs_grad,
        x.shape[-1],
        (weight.dtype, weight.shape, weight.device),
        (bias.dtype, bias.shape, bias.device),
        eps,
    )


_op: Op  # defined below, after the public function it serves (with _dispatch, its dispatch)


def poly_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-6, *, impl: str | None = None) -> torch.Tensor:
    """PolyNorm over x's last dim: ``w0·norm(x³) + w1·norm(x²) + w2·norm(x) + b``, in fp32.

    >>> import torch, polykernel
    >>> x, w, b = torch.randn(4, 8), torch.full((3,), 1 / 3), torch.tensor(1.0)
    >>> polykernel.poly_norm(x, w, b).shape
    torch.Size([4, 8])
    >>> y = polykernel.poly_norm(x, w, b, impl="torch")  # forced impl
    """
    return _dispatch(impl, x, weight, bias, eps)  # _op.dispatch; the class and validation: see _key


# -- error model (see polykernel.core.op.ErrorModel) --------------------------------------------------
# Each n_p = x^p·r_p is rms_norm's x̂ of u = x^p (p - 1 more roundings; r_p from a sum of N positive
# terms: relative error λ·√N·u32, halved by the square root), so it is off relatively by ~(8 +
# λ·√N/2)·u32. y = Σ w_p·n_p + b may cancel: absolutely, relative to max Σ|w_p·n_p| + |b|. dx sums
# three rms_norm backwards, each times p·x^(p-1): relative to the magnitude of its terms, max of
# Σ p·|x|^(p-1)·r_p·|w_p|·(1 + |n_p|) (|dy| <= 1). dw_p = Σ dy·n_p over all M·N elements, n_p off by
# the relative error above (per row, random signs across rows): relative to ‖n_p‖₂, and the sum's
# own growth; db = Σ dy: relative to √(M·N).
def _powers(x: torch.Tensor, eps: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[(p·|x|^(p-1)·r_p, n_p)] for p = 3, 2, 1, in float64 (the order of weight's elements), on x
    scaled per row as the reference is (fp64's range holds x⁶ of any fp32 x, but not of any fp64 x)."""
    v, inv, tails = scaled(x.detach().double(), eps)
    out = []
    for p, t in zip((3, 2, 1), tails):
        u = v.pow(p)
        r = torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + t)  # s^p·r_p
        out.append((p * v.abs().pow(p - 1) * r * inv, u * r))
    return out


def error_model(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-6) -> Bounds:
    _, n = rows_and_len(x)
    w = [abs(v) for v in weight.detach().double().tolist()]
    b = abs(bias.detach().double().reshape(-1)[0].item())
    y_scale = dx_scale = dw_scale = 0.0
    if x.numel():
        stats = _powers(x, eps)
        y_scale = sum(wp * norm.abs() for wp, (_, norm) in zip(w, stats)).max().item() + b
        terms = sum(d * wp * (1 + norm.abs()) for wp, (d, norm) in zip(w, stats))
        dx_scale = terms.max().item()
        dw_scale = max(norm.norm().item() for _, norm in stats)
    per_elem = 8 + 0.5 * SUM_LAMBDA * math.sqrt(max(n, 1))  # n_p's relative error, in u32
    y = ErrorModel(ops=2, cancel=per_elem, n=n, scale=y_scale)
    dx = ErrorModel(ops=4, cancel=12, sum_abs=1.5, n=n, scale=dx_scale)
    dw = ErrorModel(ops=4, cancel=per_elem, sum_abs=1, n=max(x.numel(), 1), scale=dw_scale)
    db = ErrorModel(ops=2, cancel=2, sum_abs=1, n=max(x.numel(), 1), scale=max(x.numel(), 1) ** 0.5)
    return Bounds(outputs=(y,), grads={0: dx, 1: dw, 2: db})


def example(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str, requires_grad: bool = False) -> Case:
    """Random arguments of a given x shape (benchmarks, ``explain --shape``, the demo)."""
    x = torch.randn(shape, dtype=dtype, device=device, requires_grad=requires_grad)
    w = torch.tensor([0.3, 0.35, 0.4], device=device).to(dtype).requires_grad_(requires_grad)
    b = torch.tensor(0.1, device=device).to(dtype).requires_grad_(requires_grad)
    return Case(f"{'x'.join(map(str, shape))}", (x, w, b))


def bytes_moved(x: torch.Tensor, *_: object, backward: bool = False) -> int:
    """Fewest bytes: forward reads x and writes y; backward adds x, dy read and dx written (the
    four parameters are negligible)."""
    return (5 if backward else 2) * x.numel() * x.element_size()


def cases(device: torch.device | str, dtype: torch.dtype, large: bool = False) -> list[Case]:
    """Awkward shapes and every option, sized for the CPU interpreter unless ``large``."""

    def t(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(shape, device=device)).to(dtype).requires_grad_()

    def w(*values: float, pdtype: torch.dtype = dtype) -> torch.Tensor:
        return torch.tensor(values or (0.3, 0.35, 0.4), device=device).to(pdtype).requires_grad_()

    def b(value: float = 0.1, shape: tuple[int, ...] = (), pdtype: torch.dtype = dtype) -> torch.Tensor:
        return torch.full(shape, value, device=device).to(pdtype).requires_grad_()

    out = [
        Case("1x1", (t(1, 1), w(), b())),
        Case("7-1d", (t(7), w(), b())),
        Case("3x7", (t(3, 7), w(), b())),
        Case("2x5x33-bias-1elem", (t(2, 5, 33), w(), b(0.5, (1,)))),
        Case("0x16", (t(0, 16), w(), b())),
        Case("2x3x0", (t(2, 3, 0), w(), b())),
        Case("5x96-mixed-signs", (t(5, 96), w(1.0, -1.0, 0.5), b(0.0))),  # the three terms cancel
        Case("4x64-fp32-params", (t(4, 64), w(pdtype=torch.float32), b(pdtype=torch.float32)), {"eps": 1e-5}),
        Case("6x80-small-x", (t(6, 80, scale=1e-3), w(), b())),  # mean(x⁶) << eps
        Case("4x100-large-x", (t(4, 100, scale=30.0), w(), b())),
        Case("9x200-rowstrided", (t(18, 200)[::2], w(), b())),
        Case("7x64-colstrided", (t(7, 128)[:, ::2], w(), b())),
        Case("3x20000-long", (t(3, 20000), w(), b(-0.2, (1,)))),
        Case("300x40-many-rows", (t(300, 40), w(), b())),
    ]
    if large:
        out += [
            Case("16384x4096", (t(16384, 4096), w(), b())),
            Case("4096x16384-fp32-params", (t(4096, 16384), w(pdtype=torch.float32), b(pdtype=torch.float32))),
            Case("1031x5120-odd", (t(1031, 5120), w(), b())),
            Case("64x262144", (t(64, 262144), w(), b())),
        ]
    return out


def outputs(x: torch.Tensor, *_: object) -> tuple[tuple[torch.Size, torch.dtype], ...]:
    """The reference's output shape and dtype, without running it (the first-call check)."""
    return ((x.shape, x.dtype),)


_op = Op(
    OP_ID,
    fields=("device", "dtype", "needs_grad", "n", "weight", "bias", "eps"),
    key=_key,
    guard=(LAST, SHAPE, SHAPE, None),
    default_key=lambda device, dtype: (device, dtype, False, None, (dtype, (3,), device), (dtype, (), device), 1e-6),
    validate=validate,
    reference=reference,
    outputs=outputs,
    error_model=error_model,
    dtypes=(torch.float32, torch.bfloat16, torch.float16),
    cases=cases,
    example=example,
    bytes_moved=bytes_moved,
    # impls: none here, each backend registers its own (its manifest.py: polykernel.backends)
    dtensor_layout=Layout(ROWS, rows_with(), (0,)),  # rows are independent; the parameters replicated
)
_dispatch = _op.dispatch  # bound once: ~30 ns less per call than the attribute lookup
