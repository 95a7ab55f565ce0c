"""polykernel.core.cpu_gemm: ``torch.mm`` with the CPU's slow same-layout half-precision case taken
around: the same values as ``torch.mm`` for every layout, dtype and ``out=``, and on a CPU in
half precision torch.mm is handed operands of two layouts (no timing here: the layouts are the
claim)."""

from __future__ import annotations

import pytest
import torch

from polykernel.core.cpu_gemm import mm, operands


def _layout(t: torch.Tensor, col: bool) -> torch.Tensor:
    return t.t().contiguous().t() if col else t.contiguous()


def _row_major(t: torch.Tensor) -> bool:
    return t.stride(1) == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("a_col", [False, True])
@pytest.mark.parametrize("b_col", [False, True])
@pytest.mark.parametrize("shape", [(5, 300, 7), (300, 5, 7), (1, 9, 1), (0, 4, 3)])
def test_same_values_as_torch_mm(dtype, a_col, b_col, shape):
    m, k, n = shape
    g = torch.Generator().manual_seed(0)
    a = _layout(torch.randn(m, k, generator=g).to(dtype), a_col)
    b = _layout(torch.randn(k, n, generator=g).to(dtype), b_col)
    exact = (a.double() @ b.double()).to(dtype)  # bf16/fp16 products are exact in fp32: one rounding at the end
    got = mm(a, b)
    assert got.dtype == dtype and got.shape == (m, n)
    tol = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 1e-5}[dtype] * (1 + k**0.5)
    torch.testing.assert_close(got.double(), exact.double(), rtol=tol, atol=tol)
    out = torch.full((m, n), float("nan"), dtype=dtype)
    assert mm(a, b, out=out) is out
    assert torch.equal(out, got)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_on_a_cpu_gets_two_layouts_copying_the_smaller(dtype):
    dz, w = torch.randn(4, 96).to(dtype), torch.randn(96, 16).to(dtype)  # a chunk's dZ [r, V] and the head W [V, H]
    x, y = operands(dz, w)
    assert _row_major(x) != _row_major(y)
    assert y is w and torch.equal(x, dz)  # the chunk copied, never the head
    big, small = torch.randn(96, 16).to(dtype), torch.randn(16, 4).to(dtype)
    x, y = operands(big, small)
    assert x is big and _row_major(y) is False and torch.equal(y, small)
    cols = (_layout(dz, True), _layout(w, True))  # both column-major: as slow
    x, y = operands(*cols)
    assert _row_major(x) != _row_major(y)


def test_mixed_layouts_fp32_and_other_devices_pass_through():
    a, b = torch.randn(4, 8, dtype=torch.bfloat16), _layout(torch.randn(8, 3, dtype=torch.bfloat16), True)
    assert operands(a, b) == (a, b)
    a32, b32 = torch.randn(4, 8), torch.randn(8, 3)
    x, y = operands(a32, b32)
    assert x is a32 and y is b32
    am, bm = torch.empty(4, 8, dtype=torch.bfloat16, device="meta"), torch.empty(8, 3, dtype=torch.bfloat16, device="meta")
    x, y = operands(am, bm)  # (CUDA's GEMMs take any layout: no copy there)
    assert x is am and y is bm
