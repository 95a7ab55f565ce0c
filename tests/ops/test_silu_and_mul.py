"""serving.silu_and_mul: silu of the first half times the second, on the merged [..., 2d] layout,
out=, bad input (what it shares with gelu_and_mul and the training GLUs: test_serving_glu.py)."""

import pytest
import torch
import torch.nn.functional as F

import polykernel
from _serving_helpers import DTYPES, IMPLS, check_out_is_written_and_returned, glu_bad_calls, need
from polykernel.testing import assert_parity

OP = "silu_and_mul"

# the interpreter's numpy exp overflows (harmlessly, to inf) in sigmoid for very negative inputs
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", IMPLS)
def test_parity_cpu(impl, dtype):
    need(OP, impl, dtype)
    assert_parity(OP, [impl], device="cpu", dtypes=[dtype])


def test_reference_is_silu_of_first_half_times_second():
    x = torch.randn(5, 2, 24, dtype=torch.float64)
    g, u = x[..., :12], x[..., 12:]
    torch.testing.assert_close(polykernel.silu_and_mul(x), g / (1 + torch.exp(-g)) * u, rtol=1e-15, atol=0)
    assert polykernel.explain("silu_and_mul", x).chosen == "torch"  # float64: the torch impl


def test_triton_reads_the_halves_in_place():
    need(OP, "triton")
    from polykernel.backends.triton import glu

    seen = []
    real = glu._launch

    def spy(kernel, tensors, flat, act):
        seen.append([(t.data_ptr(), t.stride()) for t in tensors])
        return real(kernel, tensors, flat, act)

    x = torch.randn(5, 80)[:, 8:72]  # rows of a wider buffer: row stride 80
    glu._launch = spy
    try:
        polykernel.silu_and_mul(x, impl="triton")
    finally:
        glu._launch = real
    ((gate, up, _),) = seen
    assert gate == (x.data_ptr(), (80, 1)) and up == (x.data_ptr() + 32 * 4, (80, 1))  # no copy of x


@pytest.mark.parametrize("impl", IMPLS)
def test_out_is_written_and_returned(impl):
    need(OP, impl)
    check_out_is_written_and_returned(polykernel.silu_and_mul, impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_no_tokens_and_no_features(impl):
    need(OP, impl)
    assert polykernel.silu_and_mul(torch.randn(0, 16), impl=impl).shape == (0, 8)
    assert polykernel.silu_and_mul(torch.randn(3, 0), impl=impl).shape == (3, 0)
    out = torch.empty(1, 1)
    assert polykernel.silu_and_mul(torch.tensor([[2.0, 3.0]]), out=out, impl=impl) is out
    torch.testing.assert_close(out, F.silu(torch.tensor([[2.0]])) * 3)


@pytest.mark.parametrize("case", glu_bad_calls(), ids=lambda c: c[0])
def test_bad_input_names_the_argument(case):
    _, call, error, arg = case
    with pytest.raises(error) as info:
        call(polykernel.silu_and_mul)
    assert info.value.op == f"serving.{OP}" and info.value.arg == arg


def test_out_in_another_buffer_row_interleaved_is_accepted():
    # out and x as column blocks of one buffer: they interleave without sharing an element
    buf = torch.randn(4, 24)
    x, out = buf[:, :16], buf[:, 16:]
    want = polykernel.silu_and_mul(x.clone())
    assert polykernel.silu_and_mul(x, out=out) is out
    torch.testing.assert_close(out, want)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_parity_gpu_large(dtype):
    assert_parity(OP, device="cuda", dtypes=[dtype], large=True)
