"""swiglu: parity of every runnable impl with the reference, layouts, saved tensors, argument errors."""

import pytest
import torch

import polykernel
from polykernel.errors import OpArgumentError, OpTypeError
from polykernel.ops.swiglu import reference
from polykernel.testing import assert_parity, runnable_impls

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
IMPLS = ["torch", "triton"]

# the interpreter's numpy exp overflows (harmlessly, to inf) in sigmoid for very negative inputs
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


def _need(impl, dtype=torch.float32):
    if impl not in runnable_impls("swiglu", "cpu", dtype):
        pytest.skip(f"{impl} not runnable on the CPU here")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", IMPLS)
def test_parity_cpu(impl, dtype):
    _need(impl, dtype)
    assert_parity("swiglu", [impl], device="cpu", dtypes=[dtype])


def test_float64_uses_torch_and_matches_reference():
    g, u = torch.randn(3, 10, dtype=torch.float64), torch.randn(3, 10, dtype=torch.float64)
    assert polykernel.explain("swiglu", g, u).chosen == "torch"
    torch.testing.assert_close(polykernel.swiglu(g, u), reference(g, u), rtol=0, atol=0)


def test_reference_is_silu_times_up():
    # the reference against the textbook formula in fp64
    g, u = torch.randn(50, dtype=torch.float64), torch.randn(50, dtype=torch.float64)
    torch.testing.assert_close(reference(g, u), g / (1 + torch.exp(-g)) * u)


@pytest.mark.parametrize("impl", IMPLS)
def test_expanded_up_and_gradients(impl):
    # up broadcast over rows (row stride 0): read in place by the row-strided path, grads summed by autograd
    _need(impl)
    g = torch.randn(6, 40, requires_grad=True)
    u0 = torch.randn(40, requires_grad=True)
    dy = torch.randn(6, 40)
    out = polykernel.swiglu(g, u0.expand(6, 40), impl=impl)
    grads = torch.autograd.grad(out, (g, u0), dy)
    g2, u2 = g.detach().clone().requires_grad_(), u0.detach().clone().requires_grad_()
    ref = reference(g2, u2.expand(6, 40))
    ref_grads = torch.autograd.grad(ref, (g2, u2), dy)
    torch.testing.assert_close(out, ref)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b)


def test_triton_layouts_without_copies():
    _need("triton")
    from polykernel.backends.triton import glu

    both = torch.randn(5, 64)
    gate, up = both[:, :32], both[:, 32:]
    for half in (gate, up):  # the fused halves are used in place
        assert glu._rows(half).data_ptr() == half.data_ptr() and glu._rows(half).stride() == (64, 1)
    t = torch.randn(32, 5).t()
    assert glu._same_dense(t, torch.randn(32, 5).t()) and not glu._same_dense(t, torch.randn(5, 32))
    assert not glu._dense(torch.randn(5, 64)[:, ::2])
    # a transposed (dense) input keeps its layout in the output
    y = polykernel.swiglu(t, torch.randn(32, 5).t(), impl="triton")
    assert y.stride() == t.stride()


@pytest.mark.parametrize("impl", IMPLS)
def test_backward_saves_only_the_inputs(impl):
    _need(impl, torch.bfloat16)
    g = torch.randn(8, 64, dtype=torch.bfloat16, requires_grad=True)
    u = torch.randn(8, 64, dtype=torch.bfloat16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        polykernel.swiglu(g, u, impl=impl)
    assert len(saved) == 2 and all(t.dtype == torch.bfloat16 and t.shape == (8, 64) for t in saved)


@pytest.mark.parametrize("impl", IMPLS)
def test_no_grad_and_partial_grad(impl):
    _need(impl)
    g, u = torch.randn(4, 9, requires_grad=True), torch.randn(4, 9)
    with torch.no_grad():
        assert polykernel.swiglu(g, u, impl=impl).grad_fn is None
    (gg,) = torch.autograd.grad(polykernel.swiglu(g, u, impl=impl).sum(), (g,))
    g2 = g.detach().clone().requires_grad_()
    (gr,) = torch.autograd.grad(reference(g2, u).sum(), (g2,))
    torch.testing.assert_close(gg, gr)


@pytest.mark.parametrize(
    "args, exc, words",
    [
        ((torch.randn(4, 8), torch.randn(4, 7)), OpArgumentError, "'up'"),
        ((torch.randn(4, 8), torch.randn(8, 4)), OpArgumentError, "'up'"),
        ((torch.randn(4, 8), torch.randn(4, 8, dtype=torch.float16)), OpTypeError, "'up'"),
        ((torch.randn(4, 8).int(), torch.randn(4, 8).int()), OpTypeError, "'gate'"),
        ((torch.randn(4, 8), torch.randn(4, 8).long()), OpTypeError, "'up'"),
        (([1.0, 2.0], torch.randn(2)), OpTypeError, "'gate'"),
        ((torch.randn(2), 3.0), OpTypeError, "'up'"),
        ((torch.randn(4, 8), torch.randn(4, 8, device="meta")), OpArgumentError, "'up'"),
    ],
)
def test_bad_input_names_op_and_argument(args, exc, words):
    with pytest.raises(exc) as info:
        polykernel.swiglu(*args)
    assert "activation.swiglu" in str(info.value) and words in str(info.value)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_parity_gpu_large(dtype):
    assert_parity("swiglu", device="cuda", dtypes=[dtype], large=True)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["flat", "fused-halves"])
def test_more_than_2_31_elements_gpu(layout):
    # element offsets past 2^31 must not wrap (int64 offsets), forward and backward
    n = 32768
    if layout == "flat":
        m = 2**31 // n + 3
        gate = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        up = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        g_in, u_in = gate, up
    else:
        m = 2**31 // (2 * n) + 3
        both = torch.randn(m, 2 * n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        g_in, u_in = both[:, :n], both[:, n:]
    y = polykernel.swiglu(g_in, u_in, impl="triton")
    dy = torch.randn_like(y)
    dg, du = torch.autograd.grad(y, (g_in, u_in), dy)
    for rows in (slice(0, 2), slice(m - 3, m)):
        g2 = g_in[rows].detach().clone().requires_grad_()
        u2 = u_in[rows].detach().clone().requires_grad_()
        ref = reference(g2, u2)
        rg, ru = torch.autograd.grad(ref, (g2, u2), dy[rows])
        torch.testing.assert_close(y[rows], ref, atol=1e-5, rtol=1e-2)
        torch.testing.assert_close(dg[rows], rg, atol=1e-5, rtol=1e-2)
        torch.testing.assert_close(du[rows], ru, atol=1e-5, rtol=1e-2)


def test_error_model_allows_sigmoid_underflow():
    # fp32 exp(-g) overflows for g < -88.72, so silu(g) comes back -0 where the exact value is up to
    # -2.6e-37 (H200: torch's and Liger's silu(-94)). That is within the model; a real error is not.
    from polykernel.ops.swiglu import error_model, reference

    gate, up = torch.tensor([[-88.8, 3.0]]), torch.tensor([[1.5, 2.0]])
    exact = reference(gate.double(), up.double())
    tol = error_model(gate, up).output(0).tol(torch.float32, exact.abs().max().item())
    flushed = exact.clone()
    flushed[0, 0] = 0.0
    assert ((flushed - exact).abs() <= tol.atol + tol.rtol * exact.abs()).all()
    wrong = exact.clone()
    wrong[0, 0] = -1e-30
    assert not ((wrong - exact).abs() <= tol.atol + tol.rtol * exact.abs()).all()
