"""geglu: parity of every runnable impl with the reference (tanh and erf), saved tensors, argument errors."""

import pytest
import torch

import polykernel
from polykernel.errors import OpArgumentError, OpTypeError
from polykernel.ops.geglu import reference
from polykernel.testing import assert_parity, runnable_impls

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
IMPLS = ["torch", "triton"]

# the interpreter's numpy exp overflows (harmlessly, to inf) in sigmoid for very negative inputs
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


def _need(impl, dtype=torch.float32):
    if impl not in runnable_impls("geglu", "cpu", dtype):
        pytest.skip(f"{impl} not runnable on the CPU here")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", IMPLS)
def test_parity_cpu(impl, dtype):
    _need(impl, dtype)
    assert_parity("geglu", [impl], device="cpu", dtypes=[dtype])


def test_float64_uses_torch_and_matches_reference():
    g, u = torch.randn(3, 10, dtype=torch.float64), torch.randn(3, 10, dtype=torch.float64)
    assert polykernel.explain("geglu", g, u).chosen == "torch"
    for approx in ("tanh", "none"):
        torch.testing.assert_close(polykernel.geglu(g, u, approx), reference(g, u, approx), rtol=0, atol=0)


@pytest.mark.parametrize("impl", IMPLS)
def test_approximations_differ_and_match_the_formulas(impl):
    # a test that could not tell tanh from erf would be useless: they differ by ~1e-4 near |g| ≈ 2
    _need(impl)
    g = torch.linspace(-6, 6, 1001, dtype=torch.float64)
    u = torch.ones_like(g)
    exact = 0.5 * g * (1 + torch.erf(g / 2**0.5))
    tanh = 0.5 * g * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (g + 0.044715 * g**3)))
    assert (exact - tanh).abs().max() > 1e-4
    gf, uf = g.float(), u.float()
    torch.testing.assert_close(polykernel.geglu(gf, uf, "none", impl=impl).double(), exact, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(polykernel.geglu(gf, uf, "tanh", impl=impl).double(), tanh, atol=2e-6, rtol=1e-5)
    assert polykernel.geglu(gf, uf, impl=impl).equal(polykernel.geglu(gf, uf, "tanh", impl=impl))  # default is tanh


@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_triton_gradient_matches_fp64_derivative(approximate):
    # the Triton backward's gelu' against autograd in fp64 (more exact than the fp32 reference)
    _need("triton")
    g = torch.linspace(-8, 8, 2001, dtype=torch.float64, requires_grad=True)
    (d64,) = torch.autograd.grad(torch.nn.functional.gelu(g, approximate=approximate).sum(), (g,))
    gf = g.detach().float().requires_grad_()
    (d32,) = torch.autograd.grad(polykernel.geglu(gf, torch.ones_like(gf), approximate, impl="triton").sum(), (gf,))
    torch.testing.assert_close(d32.double(), d64, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_backward_saves_only_the_inputs(impl):
    _need(impl, torch.bfloat16)
    g = torch.randn(8, 64, dtype=torch.bfloat16, requires_grad=True)
    u = torch.randn(8, 64, dtype=torch.bfloat16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        polykernel.geglu(g, u, impl=impl)
    assert len(saved) == 2 and all(t.dtype == torch.bfloat16 and t.shape == (8, 64) for t in saved)


@pytest.mark.parametrize(
    "args, kwargs, exc, words",
    [
        ((torch.randn(4, 8), torch.randn(4, 7)), {}, OpArgumentError, "'up'"),
        ((torch.randn(4, 8), torch.randn(4, 8, dtype=torch.bfloat16)), {}, OpTypeError, "'up'"),
        ((torch.randn(4, 8).int(), torch.randn(4, 8).int()), {}, OpTypeError, "'gate'"),
        (([1.0], torch.randn(1)), {}, OpTypeError, "'gate'"),
        ((torch.randn(4, 8), torch.randn(4, 8)), {"approximate": "erf"}, OpArgumentError, "'approximate'"),
        ((torch.randn(4, 8), torch.randn(4, 8)), {"approximate": None}, OpArgumentError, "'approximate'"),
        ((torch.randn(4, 8), torch.randn(4, 8, device="meta")), {}, OpArgumentError, "'up'"),
    ],
)
def test_bad_input_names_op_and_argument(args, kwargs, exc, words):
    with pytest.raises(exc) as info:
        polykernel.geglu(*args, **kwargs)
    assert "activation.geglu" in str(info.value) and words in str(info.value)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_parity_gpu_large(dtype):
    assert_parity("geglu", device="cuda", dtypes=[dtype], large=True)
