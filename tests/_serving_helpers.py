"""What the per-op test files of the serving ops share (tests/ops/test_{silu,gelu}_and_mul.py, the
fp8 quantisation ops' files): the merged GLUs' bad calls and ``out=`` checks, e4m3's bounds."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from polykernel.errors import OpArgumentError, OpTypeError
from polykernel.testing import runnable_impls

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
IMPLS = ["torch", "triton"]
FP8 = torch.float8_e4m3fn
U8 = 2.0**-4  # e4m3: 3 mantissa bits
TINY8 = 2.0**-10  # half its smallest subnormal


def need(op: str, impl: str, dtype: torch.dtype = torch.float32) -> None:
    if impl not in runnable_impls(op, "cpu", dtype):
        pytest.skip(f"{impl} not runnable on the CPU here")


def glu_bad_calls() -> list[tuple[str, Callable, type[Exception], str]]:
    """(label, call(fn), error, the argument named) for either merged GLU (silu/gelu_and_mul)."""
    x = torch.randn(4, 16)
    return [
        ("odd last dim", lambda fn: fn(torch.randn(4, 15)), OpArgumentError, "x"),
        ("0-d x", lambda fn: fn(torch.tensor(1.0)), OpArgumentError, "x"),
        ("integer x", lambda fn: fn(torch.ones(4, 16, dtype=torch.int32)), OpTypeError, "x"),
        ("not a tensor", lambda fn: fn([1.0, 2.0]), OpTypeError, "x"),
        ("out shape", lambda fn: fn(x, out=torch.empty(4, 16)), OpArgumentError, "out"),
        ("out dtype", lambda fn: fn(x, out=torch.empty(4, 8, dtype=torch.float16)), OpTypeError, "out"),
        ("out device", lambda fn: fn(x, out=torch.empty(4, 8, device="meta")), OpArgumentError, "out"),
        ("out inside x", lambda fn: fn(x, out=x[:, 8:]), OpArgumentError, "out"),
        ("x needs grad", lambda fn: fn(torch.randn(4, 16, requires_grad=True)), OpArgumentError, "x"),
    ]


def check_out_is_written_and_returned(fn: Callable, impl: str) -> None:
    """A merged GLU's ``out=``: contiguous, rows of a larger buffer, transposed; always in place."""
    x = torch.randn(2, 3, 40)
    want = fn(x, impl="torch")
    out = torch.full((2, 3, 20), 7.0)
    assert fn(x, out=out, impl=impl) is out
    torch.testing.assert_close(out, want)
    # out as rows of a larger buffer: written through its row stride, the rest untouched
    buf = torch.full((6, 32), 7.0)
    out = buf[:, 4:24]
    got = fn(x.reshape(6, 40), out=out, impl=impl)
    assert got is out and got.data_ptr() == buf.data_ptr() + 16
    torch.testing.assert_close(out, want.reshape(6, 20))
    assert (buf[:, :4] == 7).all() and (buf[:, 24:] == 7).all()
    # out with no row view (transposed): still written in place
    out_t = torch.full((20, 6), 7.0).t()
    assert fn(x.reshape(6, 40), out=out_t, impl=impl) is out_t
    torch.testing.assert_close(out_t, want.reshape(6, 20))


def round_trip_ok(q: torch.Tensor, scale: torch.Tensor, x: torch.Tensor) -> bool:
    """|q·scale - x| <= u8·|x| + 2^-10·scale (+ fp32 slack), elementwise, saturation aside."""
    deq = q.double() * scale.double()
    xd = x.double()
    bound = U8 * xd.abs() + TINY8 * scale.double() + 1e-6 * xd.abs()
    return bool(((deq - xd).abs() <= bound).all())


def check_gpu_kernels_store_fp8(op: str, args: tuple) -> None:
    """The one path the CPU cannot run: the Triton kernels' own fp32 -> e4m3 conversion, against
    the torch impl on the same CUDA inputs."""
    import polykernel

    if "triton" not in runnable_impls(op, "cuda", torch.bfloat16):
        pytest.skip("Triton fp8 needs sm_89+")
    fn = getattr(polykernel, op)
    got, want = fn(*args, impl="triton"), fn(*args, impl="torch")
    for g, r in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert (g.float() - r.float()).abs().max() <= (U8 * 2 * r.float().abs() + 2 * TINY8).max()
