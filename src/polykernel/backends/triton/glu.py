"""Triton gated linear units: ``act(gate) * up`` and its backward, shared by swiglu and geglu.

One elementwise kernel per direction, specialized on the activation (``ACT``: silu, gelu-tanh,
gelu-erf). Math in fp32; outputs in the inputs' dtype. The backward recomputes the activation
from ``gate`` (only the two inputs are saved) and writes both gradients in one pass:
reads gate, up, dy and writes dgate, dup (5 tensors; the forward moves 3).

Layouts, chosen per call (:func:`_same_dense`):

* *flat*: every tensor has the same strides and is non-overlapping and dense (contiguous, or a
  permutation of contiguous such as ``x.t()``): the kernels walk memory as one 1-D array of
  ``numel`` elements and the outputs take the same strides (``empty_like``). No copy.
* *rows*: otherwise each tensor is viewed as ``[M, N]`` with unit column stride and its own row
  stride (e.g. the two halves of a fused ``[M, 2N]`` projection, or an ``expand``-ed input with
  row stride 0) — a copy happens only when no such view exists (column stride != 1).

The serving layout (``silu_and_mul``/``gelu_and_mul``: gate and up as the two halves of one
``[..., 2d]`` row) runs the same forward kernel on row-strided views of the halves, writing a
given output (:func:`glu_and_mul`).

Each program handles a ``[ROWS, BLOCK]`` tile (ROWS > 1 only for short rows), with an int64
scalar base offset and int32 in-tile offsets, so 16-byte vector accesses stay possible and
tensors of more than 2^31 elements are addressed correctly.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .._fallback import registered
from .._functions import glu_function
from . import _native
from ._autograd import lean_apply
from ._autograd import transforms_active as _transforms_active
from ._launch import launch
from ._rows import cdiv as _cdiv
from ._rows import next_pow2 as _next_pow2

# what this impl does not take goes to the torch impl, resolved by name on first use (polykernel.backends._fallback)
_torch_geglu = registered("activation.geglu")
_torch_swiglu = registered("activation.swiglu")

SILU, GELU_TANH, GELU_ERF = 0, 1, 2
ACTS = {"silu": SILU, "tanh": GELU_TANH, "none": GELU_ERF}

BLOCK_MAX = 4096  # elements per program (bf16: 8 KiB per tensor; 16 per thread at 8 warps)
ELEMS_PER_THREAD = 16  # a program's warps: its tile over 32 threads of this many elements each ...
MAX_WARPS = 8  # ... at most this many (benchmarks/kernels/kernel_variants.py A/Bs the three)
# GELU-tanh: z = √(2/π)·(g + 0.044715·g³) and 0.5·(1 + tanh z) = sigmoid(2z) = sigmoid(g·(K2 + K2C·g²))
_K2 = tl.constexpr(1.5957691216057308)  # 2·√(2/π)
_K2C = tl.constexpr(0.0713548162726009)  # 2·√(2/π)·0.044715
_K2C3 = tl.constexpr(0.2140644488178027)  # 3·_K2C
_INV_SQRT_2 = tl.constexpr(0.7071067811865476)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)


# ---------------------------------------------------------------------------------------------
# Kernels


# (tensor operands come first: the interpreter cannot multiply a constexpr global by a tensor)
@triton.jit
def _act_fwd(g, ACT: tl.constexpr):
    """act(g) in fp32."""
    if ACT == 0:
        return g * tl.sigmoid(g)
    elif ACT == 1:
        # 0.5·(1 + tanh z) as sigmoid(2z): no tanh needed, and no cancellation for g << 0
        return g * tl.sigmoid(g * (g * g * _K2C + _K2))
    else:
        return g * ((tl.erf(g * _INV_SQRT_2) + 1.0) * 0.5)


@triton.jit
def _act_fwd_bwd(g, ACT: tl.constexpr):
    """(act(g), act'(g)) in fp32."""
    if ACT == 0:
        s = tl.sigmoid(g)
        a = g * s
        d = s * (1.0 + g * (1.0 - s))
    elif ACT == 1:
        g2 = g * g
        cdf = tl.sigmoid(g * (g2 * _K2C + _K2))
        a = g * cdf
        # d/dg [g·σ(2z)] = σ + g·σ(1-σ)·2z'   (1 - tanh² z = 4σ(1-σ)),  2z' = K2 + 3·K2C·g²
        d = cdf + g * (cdf * (1.0 - cdf)) * (g2 * _K2C3 + _K2)
    else:
        cdf = (tl.erf(g * _INV_SQRT_2) + 1.0) * 0.5
        a = g * cdf
        d = cdf + g * (tl.exp(g * g * -0.5) * _INV_SQRT_2PI)
    return a, d


@triton.jit
def _glu_fwd_kernel(
    G, U, Y,
    M, N, col_blocks,
    stride_g, stride_u, stride_y,
    ACT: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    rb = pid // col_blocks
    row0 = tl.cast(rb, tl.int64) * ROWS
    col0 = tl.cast(pid - rb * col_blocks, tl.int64) * BLOCK
    r = tl.arange(0, ROWS)
    c = tl.arange(0, BLOCK)
    mask = (r < M - row0)[:, None] & (c < N - col0)[None, :]
    g = tl.load(G + (row0 * stride_g + col0) + (r[:, None] * stride_g + c[None, :]), mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + (row0 * stride_u + col0) + (r[:, None] * stride_u + c[None, :]), mask=mask, other=0.0).to(tl.float32)
    y = _act_fwd(g, ACT) * u
    tl.store(Y + (row0 * stride_y + col0) + (r[:, None] * stride_y + c[None, :]), y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _glu_bwd_kernel(
    G, U, DY, DG, DU,
    M, N, col_blocks,
    stride_g, stride_u, stride_dy, stride_dg, stride_du,
    ACT: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    rb = pid // col_blocks
    row0 = tl.cast(rb, tl.int64) * ROWS
    col0 = tl.cast(pid - rb * col_blocks, tl.int64) * BLOCK
    r = tl.arange(0, ROWS)
    c = tl.arange(0, BLOCK)
    mask = (r < M - row0)[:, None] & (c < N - col0)[None, :]
    g = tl.load(G + (row0 * stride_g + col0) + (r[:, None] * stride_g + c[None, :]), mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + (row0 * stride_u + col0) + (r[:, None] * stride_u + c[None, :]), mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + (row0 * stride_dy + col0) + (r[:, None] * stride_dy + c[None, :]), mask=mask, other=0.0).to(tl.float32)
    a, d = _act_fwd_bwd(g, ACT)
    tl.store(DG + (row0 * stride_dg + col0) + (r[:, None] * stride_dg + c[None, :]), (dy * u * d).to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + (row0 * stride_du + col0) + (r[:, None] * stride_du + c[None, :]), (dy * a).to(DU.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------
# Host side


def _layout(t: torch.Tensor) -> tuple[int, ...]:
    """Strides that matter for addressing (size-1 dims can carry any stride)."""
    return tuple(st for size, st in zip(t.shape, t.stride()) if size != 1)


def _dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: the elements fill ``numel`` consecutive slots (any dim order)."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((st, size) for size, st in zip(t.shape, t.stride()) if size != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A ``[M, N]`` view with unit column stride (copies only when the layout needs it)."""
    n = t.shape[-1] if t.dim() else 1
    t2 = t.reshape(-1, n)
    return t2 if t2.stride(-1) == 1 or t2.numel() == 0 else t2.contiguous()


@functools.lru_cache(maxsize=4096)  # host time: decode shapes repeat on every call
def _tile(m: int, n: int) -> tuple[int, int, int]:
    """(BLOCK, ROWS, num_warps) for m rows of n elements: up to BLOCK_MAX elements per program."""
    block = min(BLOCK_MAX, _next_pow2(max(n, 1)))
    rows = min(max(1, BLOCK_MAX // block), _next_pow2(max(m, 1)))
    warps = max(1, min(MAX_WARPS, block * rows // (32 * ELEMS_PER_THREAD)))
    return block, rows, warps


def _fit(m: int, n: int, strides: list[int]) -> tuple[int, int, int]:
    """:func:`_tile` for tensors of these row strides."""
    block, rows, warps = _tile(m, n)
    # in-tile offsets are int32: keep (ROWS-1)·stride + BLOCK below 2^31 (huge strides: one row per tile)
    if rows > 1 and (rows - 1) * max(map(abs, strides)) + block >= 2**31:
        rows = 1
    return block, rows, warps


def _launch(kernel, tensors: list[torch.Tensor], flat: bool, act: int) -> None:
    """Run ``kernel`` on same-shape tensors (inputs first, then outputs)."""
    if flat:
        m, n, strides = 1, tensors[0].numel(), [0] * len(tensors)
    else:
        m, n = tensors[0].shape
        strides = [t.stride(0) for t in tensors]
    block, rows, warps = _fit(m, n, strides)
    col_blocks = _cdiv(n, block)
    grid = (_cdiv(m, rows) * col_blocks,)
    launch(kernel, grid, *tensors, m, n, col_blocks, *strides, ACT=act, BLOCK=block, ROWS=rows, num_warps=warps)


def _same_dense(*ts: torch.Tensor) -> bool:
    """All tensors share one dense layout: the flat walk addresses them alike."""
    for t in ts:  # the usual case, contiguous tensors (of one shape: validated), without Python loops
        if not t.is_contiguous():
            break
    else:
        return True
    lay = _layout(ts[0])
    return all(_layout(t) == lay for t in ts) and _dense(ts[0])


def _contiguous_like(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else torch.empty(like.shape, dtype=like.dtype, device=like.device)


def _n(t: torch.Tensor) -> int:
    return t.shape[-1] if t.dim() else 1


def glu_forward(gate: torch.Tensor, up: torch.Tensor, act: int) -> torch.Tensor:
    """``act(gate) * up`` with gate's shape and dtype (and gate's layout when it is dense)."""
    y = torch.empty_like(gate)
    if y.numel() == 0:
        return y
    if _same_dense(gate, up, y):
        _launch(_glu_fwd_kernel, [gate, up, y], True, act)
        return y
    y = _contiguous_like(y, gate)
    _launch(_glu_fwd_kernel, [_rows(gate), _rows(up), y.view(-1, _n(y))], False, act)
    return y


def glu_backward(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, act: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dup) in the inputs' dtype, recomputing act(gate) from gate."""
    dg, du = torch.empty_like(gate), torch.empty_like(gate)
    if dg.numel() == 0:
        return dg, du
    if _same_dense(gate, up, dy, dg, du):
        _launch(_glu_bwd_kernel, [gate, up, dy, dg, du], True, act)
        return dg, du
    dg, du = _contiguous_like(dg, gate), _contiguous_like(du, gate)
    n = _n(gate)
    _launch(_glu_bwd_kernel, [_rows(gate), _rows(up), _rows(dy), dg.view(-1, n), du.view(-1, n)], False, act)
    return dg, du


def _row_view(t: torch.Tensor, n: int) -> torch.Tensor | None:
    """``t`` as a ``[M, n]`` view with unit column stride (no copy), or None if there is none."""
    try:
        v = t.view(-1, n)
    except RuntimeError:  # leading dims that do not collapse into one row stride
        return None
    return v if v.stride(1) == 1 or n == 1 else None


def glu_and_mul(x: torch.Tensor, out: torch.Tensor | None, act: int) -> torch.Tensor:
    """The serving layout: ``act(x[..., :d]) * x[..., d:]`` written into ``out`` ``[..., d]``.

    The forward kernel's rows path on views of the two halves of each ``[M, 2d]`` row (row
    stride 2d, or x's own): x is copied only when its last dim is strided. ``out`` is written
    through its own row stride; one that has none (e.g. a transposed view) gets the result
    through a temporary and a copy. Contiguous x and out (or none) launch from C++ when the
    native path is on (:class:`_AndMulPlan`)."""
    if _native.ENABLED:
        y = _native.call("glu_and_mul", (x, out, act), (x, act), _and_mul_plan)
        if y is not None:
            return y
    n = x.shape[-1]
    d = n // 2
    if out is None:
        out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    x2 = _rows(x)
    o2 = _row_view(out, d)
    target = o2 if o2 is not None else torch.empty((x2.shape[0], d), dtype=out.dtype, device=out.device)
    _launch(_glu_fwd_kernel, [x2[:, :d], x2[:, d:], target], False, act)
    if o2 is None:
        out.copy_(target.view(out.shape))
    return out


GLUFunction = glu_function(glu_forward, glu_backward)  # the autograd node, shared with the other kernel backends


_lean_apply = lean_apply(GLUFunction)  # GLUFunction.apply without its Python wrapper (see _autograd.py)


def _torch_glu(gate: torch.Tensor, up: torch.Tensor, act: int) -> torch.Tensor:
    """The torch impl of the op that ``act`` stands for."""
    if act == SILU:
        return _torch_swiglu(gate, up)
    return _torch_geglu(gate, up, "tanh" if act == GELU_TANH else "none")


class _NativePlan:
    """The C++ path's plan for contiguous inputs of one size (the flat walk): slots and block."""

    def __init__(self, numel: int, act: int) -> None:
        self.block, rows, warps = _tile(1, numel)
        self.fwd = _native.slot(_glu_fwd_kernel, ACT=act, BLOCK=self.block, ROWS=rows, num_warps=warps)
        self.bwd = _native.slot(_glu_bwd_kernel, ACT=act, BLOCK=self.block, ROWS=rows, num_warps=warps)


def _native_plan(gate: torch.Tensor, up: torch.Tensor, act: int) -> _NativePlan:
    return _NativePlan(gate.numel(), act)


def _and_mul_tile(m: int, d: int, act: int) -> _native.RowTile:
    """The forward kernel's slot for x [m, 2d] and out [m, d], both contiguous."""
    block, rows, warps = _fit(m, d, [2 * d, 2 * d, d])
    return _native.RowTile(_native.slot(_glu_fwd_kernel, ACT=act, BLOCK=block, ROWS=rows, num_warps=warps), rows)


class _AndMulPlan:
    """The C++ path's plan for the serving layout (:func:`glu_and_mul`), per d: a tile for each
    power of two of M up to the largest ROWS :func:`_tile` gives (BLOCK_MAX // BLOCK)."""

    def __init__(self, d: int, act: int) -> None:
        self.block = _tile(1, d)[0]
        self.tiles = _native.row_tiles(BLOCK_MAX // self.block, lambda m: _and_mul_tile(m, d, act))


def _and_mul_plan(x: torch.Tensor, act: int) -> _AndMulPlan | None:
    d = x.shape[-1] // 2 if x.dim() else 0
    return _AndMulPlan(d, act) if d > 0 else None


def glu(gate: torch.Tensor, up: torch.Tensor, act: int) -> torch.Tensor:
    """Forward (with autograd when a grad is needed) of ``act(gate) * up``; args validated."""
    if _native.ENABLED:
        y = _native.call("glu", (gate, up, act), (gate, up, act), _native_plan)
        if y is not None:
            return y
    if _transforms_active():  # functorch (vmap, grad): the kernels cannot read its wrapped tensors
        return _torch_glu(gate, up, act)
    if (gate.requires_grad or up.requires_grad) and torch.is_grad_enabled():
        return _lean_apply(gate, up, act)
    return glu_forward(gate, up, act)
