"""serving.fused_add_rms_norm_: in place over x and residual, the training op's kernel, bad input."""

import pytest
import torch

import polykernel
from polykernel.errors import OpArgumentError, OpTypeError
from polykernel.testing import assert_parity, runnable_impls

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
IMPLS = ["torch", "triton"]


def _need(impl, dtype=torch.float32):
    if impl not in runnable_impls("fused_add_rms_norm_", "cpu", dtype):
        pytest.skip(f"{impl} not runnable on the CPU here")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", IMPLS)
def test_parity_cpu(impl, dtype):
    _need(impl, dtype)
    assert_parity("fused_add_rms_norm_", [impl], device="cpu", dtypes=[dtype])


@pytest.mark.parametrize("n", [64, 20001], ids=["one-block", "chunked"])
@pytest.mark.parametrize("impl", IMPLS)
def test_in_place_equals_the_training_op_bit_for_bit(impl, n):
    # same kernel, outputs pointed at the inputs: the chunked walk reads s back instead of re-adding
    _need(impl, torch.bfloat16)
    x = torch.randn(3, n, dtype=torch.bfloat16)
    r = 10 * torch.randn(3, n, dtype=torch.bfloat16)
    w = (1 + 0.1 * torch.randn(n)).to(torch.bfloat16)
    y, s = polykernel.fused_add_rms_norm(x, r, w, 1e-5, offset=0.5, impl=impl)
    x_ptr, r_ptr = x.data_ptr(), r.data_ptr()
    got_x, got_r = polykernel.fused_add_rms_norm_(x, r, w, 1e-5, offset=0.5, impl=impl)
    assert got_x is x and got_r is r and x.data_ptr() == x_ptr and r.data_ptr() == r_ptr
    assert torch.equal(x, y) and torch.equal(r, s)


@pytest.mark.parametrize("impl", IMPLS)
def test_strided_rows_are_written_in_place(impl):
    _need(impl)
    big_x, big_r = torch.randn(6, 100), torch.randn(6, 90)
    x, r = big_x[:, 10:74], big_r[:, 5:69]  # row strides 100 and 90
    w = torch.randn(64)
    y, s = polykernel.fused_add_rms_norm(x.clone(), r.clone(), w, impl="torch")
    keep_x, keep_r = big_x.clone(), big_r.clone()
    polykernel.fused_add_rms_norm_(x, r, w, impl=impl)
    torch.testing.assert_close(x, y)
    torch.testing.assert_close(r, s)
    for big, keep, lo, hi in ((big_x, keep_x, 10, 74), (big_r, keep_r, 5, 69)):
        assert torch.equal(big[:, :lo], keep[:, :lo]) and torch.equal(big[:, hi:], keep[:, hi:])
    # no row view (transposed x): through temporaries, then copied back over the same storage
    xt = torch.randn(64, 6).t()
    r2 = torch.randn(6, 64)
    y, s = polykernel.fused_add_rms_norm(xt.clone(), r2.clone(), w, impl="torch")
    got, _ = polykernel.fused_add_rms_norm_(xt, r2, w, impl=impl)
    assert got is xt
    torch.testing.assert_close(xt, y)
    torch.testing.assert_close(r2, s)


@pytest.mark.parametrize("impl", IMPLS)
def test_no_tokens(impl):
    _need(impl)
    x, r = torch.randn(0, 8), torch.randn(0, 8)
    assert polykernel.fused_add_rms_norm_(x, r, torch.ones(8), impl=impl) == (x, r)


def _args():
    return torch.randn(4, 16), torch.randn(4, 16), torch.ones(16)


BAD = [
    ("residual dtype", lambda x, r, w: (x, r.double(), w), {}, OpTypeError, "residual"),
    ("residual shape", lambda x, r, w: (x, r[:3], w), {}, OpArgumentError, "residual"),
    ("residual device", lambda x, r, w: (x, torch.empty(4, 16, device="meta"), w), {}, OpArgumentError, "residual"),
    ("weight shape", lambda x, r, w: (x, r, w[:8]), {}, OpArgumentError, "weight"),
    ("integer x", lambda x, r, w: (x.int(), r.int(), w), {}, OpTypeError, "x"),
    ("negative eps", lambda x, r, w: (x, r, w, -1.0), {}, OpArgumentError, "eps"),
    ("nan offset", lambda x, r, w: (x, r, w), {"offset": float("nan")}, OpArgumentError, "offset"),
    ("residual is x", lambda x, r, w: (x, x, w), {}, OpArgumentError, "residual"),
    ("residual inside x", lambda x, r, w: (x[:, :8], x[:, 4:12], w[:8]), {}, OpArgumentError, "residual"),
    ("x needs grad", lambda x, r, w: (x.requires_grad_(), r, w), {}, OpArgumentError, "x"),
    ("weight needs grad", lambda x, r, w: (x, r, w.requires_grad_()), {}, OpArgumentError, "weight"),
]


@pytest.mark.parametrize("case", BAD, ids=lambda c: c[0])
def test_bad_input_raises_before_anything_is_written(case):
    _, make, kwargs, error, arg = case
    x, r, w = _args()
    args = make(x, r, w)
    before = [a.detach().clone() for a in args[:2]]
    with pytest.raises(error) as info:
        polykernel.fused_add_rms_norm_(*args, **kwargs)
    assert info.value.op == "serving.fused_add_rms_norm_" and info.value.arg == arg
    for a, b in zip(args[:2], before):
        if a.device.type != "meta":
            assert torch.equal(a.detach(), b)  # never half-written


def test_slices_of_one_buffer_that_do_not_share_elements_are_accepted():
    buf = torch.randn(4, 32)
    x, r = buf[:, :16], buf[:, 16:]
    y, s = polykernel.fused_add_rms_norm(x.clone(), r.clone(), torch.ones(16))
    polykernel.fused_add_rms_norm_(x, r, torch.ones(16))
    torch.testing.assert_close(x, y)
    torch.testing.assert_close(r, s)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_parity_gpu_large(dtype):
    assert_parity("fused_add_rms_norm_", device="cuda", dtypes=[dtype], large=True)
