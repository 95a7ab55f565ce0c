"""serving.gelu_and_mul: gelu (erf or tanh) of the first half times the second, on the merged
[..., 2d] layout, out=, inf gates, bad input (what it shares with silu_and_mul and the training
GLUs: test_serving_glu.py)."""

import pytest
import torch
import torch.nn.functional as F

import polykernel
from _serving_helpers import DTYPES, IMPLS, check_out_is_written_and_returned, glu_bad_calls, need
from polykernel.errors import OpArgumentError
from polykernel.testing import assert_parity, runnable_impls

OP = "gelu_and_mul"

# the interpreter's numpy exp overflows (harmlessly, to inf) in sigmoid for very negative inputs
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", IMPLS)
def test_parity_cpu(impl, dtype):
    need(OP, impl, dtype)
    assert_parity(OP, [impl], device="cpu", dtypes=[dtype])


def test_reference_is_gelu_of_first_half_times_second():
    x = torch.randn(5, 2, 24, dtype=torch.float64)
    g, u = x[..., :12], x[..., 12:]
    torch.testing.assert_close(polykernel.gelu_and_mul(x), 0.5 * g * (1 + torch.erf(g / 2**0.5)) * u, rtol=1e-14, atol=1e-15)
    torch.testing.assert_close(polykernel.gelu_and_mul(x, approximate="tanh"), F.gelu(g, approximate="tanh") * u, rtol=1e-15, atol=0)


@pytest.mark.parametrize("impl", IMPLS)
def test_out_is_written_and_returned(impl):
    need(OP, impl)
    check_out_is_written_and_returned(polykernel.gelu_and_mul, impl)


@pytest.mark.parametrize("case", glu_bad_calls(), ids=lambda c: c[0])
def test_bad_input_names_the_argument(case):
    _, call, error, arg = case
    with pytest.raises(error) as info:
        call(polykernel.gelu_and_mul)
    assert info.value.op == f"serving.{OP}" and info.value.arg == arg


def test_unknown_approximate_names_the_argument():
    with pytest.raises(OpArgumentError) as info:
        polykernel.gelu_and_mul(torch.randn(4, 16), approximate="erf")
    assert info.value.op == f"serving.{OP}" and info.value.arg == "approximate"


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


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_parity_gpu_large(dtype):
    assert_parity(OP, device="cuda", dtypes=[dtype], large=True)
