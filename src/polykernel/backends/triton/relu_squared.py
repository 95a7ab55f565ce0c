"""Triton ReLU²: ``relu(x)²`` and its backward ``2·relu(x)·dy``, one elementwise pass each way.

The kernels walk memory as one 1-D array of ``numel`` elements: x in its own dense layout
(contiguous, or a permutation of contiguous such as ``x.t()``), the output in the same strides
(``empty_like``), no copy; any other layout (a strided slice) is copied to contiguous first.
Math in fp32; only x is saved for the backward, which recomputes relu(x). No reductions: the
result does not depend on the launch (deterministic).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...ops.relu_squared import reference
from .._double_backward import graph_grads
from .._fallback import registered
from ._autograd import lean_apply
from ._autograd import transforms_active as _transforms_active
from ._launch import launch
from ._rows import cdiv as _cdiv

# what this impl does not take goes to the torch impl, resolved by name on first use (polykernel.backends._fallback)
_torch_relu_squared = registered("activation.relu_squared")

BLOCK = 4096  # elements per program (bf16: 8 KiB per tensor)

# ---------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _relu2_fwd_kernel(X, Y, numel, BLOCK: tl.constexpr):
    base = tl.program_id(0).to(tl.int64) * BLOCK  # int64 base, int32 in-block offsets (16-byte accesses)
    offs = tl.arange(0, BLOCK)
    m = offs < numel - base
    x = tl.load(X + base + offs, mask=m, other=0.0).to(tl.float32)
    r = tl.where(x < 0.0, 0.0, x)  # relu that keeps NaN (tl.maximum may drop it)
    tl.store(Y + base + offs, (r * r).to(Y.dtype.element_ty), mask=m)


@triton.jit
def _relu2_bwd_kernel(X, DY, DX, numel, BLOCK: tl.constexpr):
    base = tl.program_id(0).to(tl.int64) * BLOCK
    offs = tl.arange(0, BLOCK)
    m = offs < numel - base
    x = tl.load(X + base + offs, mask=m, other=0.0).to(tl.float32)
    dy = tl.load(DY + base + offs, mask=m, other=0.0).to(tl.float32)
    dx = tl.where(x <= 0.0, 0.0, 2.0 * x * dy)  # NaN stays NaN, as in torch's relu backward
    tl.store(DX + base + offs, dx.to(DX.dtype.element_ty), mask=m)


# ---------------------------------------------------------------------------------------------
# Host launchers


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


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Two tensors of one shape whose elements sit at the same offsets (size-1 dims aside)."""
    return all(sa == sb for n, sa, sb in zip(a.shape, a.stride(), b.stride()) if n != 1)


def relu_squared_forward(x: torch.Tensor) -> torch.Tensor:
    """``relu(x)²`` with x's shape and dtype (and x's layout when it is dense)."""
    if not _dense(x):
        x = x.contiguous()
    y = torch.empty_like(x)  # a dense x's strides: the flat walk addresses both alike
    if y.numel():
        launch(_relu2_fwd_kernel, (_cdiv(x.numel(), BLOCK),), x, y, x.numel(), BLOCK=BLOCK, num_warps=8)
    return y


def relu_squared_backward(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``2·relu(x)·dy`` with x's shape and dtype."""
    if not (_dense(x) and _same_layout(x, dy)):
        x, dy = x.contiguous(), dy.contiguous()
    dx = torch.empty_like(x)
    if dx.numel():
        launch(_relu2_bwd_kernel, (_cdiv(x.numel(), BLOCK),), x, dy, dx, x.numel(), BLOCK=BLOCK, num_warps=8)
    return dx


# ---------------------------------------------------------------------------------------------
# Registered impl


class _ReLUSquared(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        ctx.save_for_backward(x)
        return relu_squared_forward(x)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: the reference's differentiable gradient
            return graph_grads(reference, (x,), (dy,), (True,))[0]
        return relu_squared_backward(dy, x)


_lean_apply = lean_apply(_ReLUSquared)  # _ReLUSquared.apply without its Python wrapper (see _autograd.py)


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    """The registered impl (arguments already validated by ``polykernel.relu_squared``)."""
    if _transforms_active():  # functorch (vmap, grad): the kernels cannot read its wrapped tensors
        return _torch_relu_squared(x)
    if x.requires_grad and torch.is_grad_enabled():
        return _lean_apply(x)
    return relu_squared_forward(x)
