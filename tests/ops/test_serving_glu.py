"""serving.silu_and_mul / serving.gelu_and_mul: the merged [..., 2d] layout, out=, shared kernels, bad input."""

import pytest
import torch
import torch.nn.functional as F

import polykernel
from polykernel.errors import OpArgumentError, OpTypeError
from polykernel.testing import assert_parity, runnable_impls

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
IMPLS = ["torch", "triton"]
OPS = ["silu_and_mul", "gelu_and_mul"]

# the interpreter's numpy exp overflows (harmlessly, to inf) in sigmoid for very negative inputs
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


def _need(op, impl, dtype=torch.float32):
    if impl not in runnable_impls(op, "cpu", dtype):
        pytest.skip(f"{impl} not runnable on the CPU here")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op", OPS)
def test_parity_cpu(op, impl, dtype):
    _need(op, impl, dtype)
    assert_parity(op, [impl], device="cpu", dtypes=[dtype])


def test_reference_is_act_of_first_half_times_second():
    x = torch.randn(5, 2, 24, dtype=torch.float64)
    g, u = x[..., :12], x[..., 12:]
    torch.testing.assert_close(polykernel.silu_and_mul(x), g / (1 + torch.exp(-g)) * u, rtol=1e-15, atol=0)
    torch.testing.assert_close(polykernel.gelu_and_mul(x), 0.5 * g * (1 + torch.erf(g / 2**0.5)) * u, rtol=1e-14, atol=1e-15)
    torch.testing.assert_close(polykernel.gelu_and_mul(x, approximate="tanh"), F.gelu(g, approximate="tanh") * u, rtol=1e-15, atol=0)
    assert polykernel.explain("silu_and_mul", x).chosen == "torch"  # float64: the torch impl


@pytest.mark.parametrize("impl", IMPLS)
def test_same_math_and_kernel_as_the_training_glus(impl):
    # the layout differs, not the kernel: bit for bit the training op's result on the two halves
    _need("silu_and_mul", impl, torch.bfloat16)
    x = torch.randn(7, 2 * 300, dtype=torch.bfloat16)
    g, u = x[:, :300], x[:, 300:]
    assert torch.equal(polykernel.silu_and_mul(x, impl=impl), polykernel.swiglu(g, u, impl=impl))
    for approx in ("none", "tanh"):
        assert torch.equal(polykernel.gelu_and_mul(x, approximate=approx, impl=impl), polykernel.geglu(g, u, approx, impl=impl))


def test_triton_reads_the_halves_in_place():
    _need("silu_and_mul", "triton")
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
@pytest.mark.parametrize("op", OPS)
def test_out_is_written_and_returned(op, impl):
    _need(op, impl)
    fn = getattr(polykernel, op)
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


@pytest.mark.parametrize("impl", IMPLS)
def test_no_tokens_and_no_features(impl):
    _need("silu_and_mul", impl)
    assert polykernel.silu_and_mul(torch.randn(0, 16), impl=impl).shape == (0, 8)
    assert polykernel.silu_and_mul(torch.randn(3, 0), impl=impl).shape == (3, 0)
    out = torch.empty(1, 1)
    assert polykernel.silu_and_mul(torch.tensor([[2.0, 3.0]]), out=out, impl=impl) is out
    torch.testing.assert_close(out, F.silu(torch.tensor([[2.0]])) * 3)


def _bad_calls():
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


@pytest.mark.parametrize("case", _bad_calls(), ids=lambda c: c[0])
@pytest.mark.parametrize("op", OPS)
def test_bad_input_names_the_argument(op, case):
    _, call, error, arg = case
    with pytest.raises(error) as info:
        call(getattr(polykernel, op))
    assert info.value.op == f"serving.{op}" and info.value.arg == arg


def test_nothing_is_written_when_validation_fails():
    x = torch.randn(4, 16)
    buf = torch.full((4, 16), 7.0)
    with pytest.raises(OpArgumentError, match="overlaps"):
        polykernel.silu_and_mul(buf, out=buf[:, :8])
    assert (buf == 7).all()
    out = torch.full((4, 8), 7.0)
    with pytest.raises(OpArgumentError, match="approximate"):
        polykernel.gelu_and_mul(x, approximate="erf", out=out)
    assert (out == 7).all()


def test_out_in_another_buffer_row_interleaved_is_accepted():
    # out and x as column blocks of one buffer: they interleave without sharing an element
    buf = torch.randn(4, 24)
    x, out = buf[:, :16], buf[:, 16:]
    want = polykernel.silu_and_mul(x.clone())
    assert polykernel.silu_and_mul(x, out=out) is out
    torch.testing.assert_close(out, want)


def _nonfinite_gate(n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Gates ±inf against ups of each sign and 0, long enough for PyTorch's vectorized CPU path."""
    inf = float("inf")
    g = torch.tensor([inf, inf, inf, -inf, -inf, 1.0, 0.5, -2.0]).repeat(n // 8)
    u = torch.tensor([2.0, -3.0, 0.0, 2.0, -1.0, inf, -inf, 1.0]).repeat(n // 8)
    return g, u


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_every_impl_gives_torchs_scalar_gelu_at_inf(approximate):
    # gelu(+inf) = +inf (the product inf·up: ±inf, NaN for up = 0); gelu(-inf) = -inf·Φ(-inf) is
    # NaN, as on every torch path. PyTorch's vectorized fp32 CPU erf-GELU gave NaN at +inf, so
    # the torch impl disagreed with Triton's inf.
    g, u = _nonfinite_gate()
    want = F.gelu(g.double(), approximate=approximate) * u.double()  # fp64: the scalar answer
    assert want[0] == float("inf") and want[1] == -float("inf") and want[3].isnan()
    x = torch.cat([g, u])[None]
    for impl in runnable_impls("gelu_and_mul", "cpu", torch.float32):
        got = polykernel.gelu_and_mul(x, approximate=approximate, impl=impl)[0]
        torch.testing.assert_close(got, want.float(), equal_nan=True, msg=f"gelu_and_mul {impl}")
    for impl in runnable_impls("geglu", "cpu", torch.float32):
        got = polykernel.geglu(g[None], u[None], approximate, impl=impl)[0]
        torch.testing.assert_close(got, want.float(), equal_nan=True, msg=f"geglu {impl}")
