"""poly_norm: parity of every runnable impl with the reference (fixed and drawn cases), gradients of
the weight and bias in their shapes, determinism, torch.compile, argument errors."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import polykernel
from _property import check_case, draw_dtype, layout, property_settings
from polykernel.core.op import Case
from polykernel.errors import OpArgumentError, OpTypeError
from polykernel.ops.poly_norm import reference
from polykernel.testing import assert_parity, runnable_impls

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
IMPLS = ["torch", "triton"]


def _need(impl, dtype=torch.float32):
    if impl not in runnable_impls("poly_norm", "cpu", dtype):
        pytest.skip(f"{impl} not runnable on the CPU here")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", IMPLS)
def test_parity_cpu(impl, dtype):
    _need(impl, dtype)
    assert_parity("poly_norm", [impl], device="cpu", dtypes=[dtype])


def test_reference_is_the_polycom_formula():
    # PolyCom's PolyNorm (github.com/BryceZhuo/PolyCom), written out in fp64
    x = torch.randn(4, 9, dtype=torch.float64)
    w, b = torch.tensor([0.2, -0.5, 1.5], dtype=torch.float64), torch.tensor(0.25, dtype=torch.float64)

    def norm(u):
        return u / torch.sqrt(u.pow(2).mean(-1, keepdim=True) + 1e-6)

    want = w[0] * norm(x**3) + w[1] * norm(x**2) + w[2] * norm(x) + b
    torch.testing.assert_close(reference(x, w, b), want, rtol=1e-13, atol=1e-13)
    assert polykernel.explain("poly_norm", x, w, b).chosen == "torch"  # fp64: only the torch impl


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bias_shape", [(), (1,)], ids=["0d", "1elem"])
def test_weight_and_bias_gradients_in_their_shapes_and_dtypes(impl, bias_shape):
    _need(impl)
    x = torch.randn(5, 3, 12, requires_grad=True)
    w = torch.tensor([0.3, -0.2, 0.9], dtype=torch.float64, requires_grad=True)  # another dtype than x
    b = torch.full(bias_shape, 0.5, requires_grad=True)
    dy = torch.randn(5, 3, 12)
    got = torch.autograd.grad(polykernel.poly_norm(x, w, b, impl=impl), (x, w, b), dy)
    want = torch.autograd.grad(reference(x, w, b), (x, w, b), dy)
    for g, r, t in zip(got, want, (x, w, b)):
        assert g.shape == t.shape and g.dtype == t.dtype
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("which", ["x", "weight", "bias"])
def test_gradient_of_one_input_only(impl, which):
    _need(impl)
    args = {"x": torch.randn(6, 50), "weight": torch.tensor([0.3, 0.35, 0.4]), "bias": torch.tensor(0.1)}
    args[which].requires_grad_()
    dy = torch.randn(6, 50)
    got = torch.autograd.grad(polykernel.poly_norm(*args.values(), impl=impl), args[which], dy)[0]
    want = torch.autograd.grad(reference(*args.values()), args[which], dy)[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("shape", [(67, 96), (5, 17000)], ids=["tile", "chunked"])
def test_triton_backward_is_deterministic(shape):
    _need("triton")
    x = torch.randn(shape, requires_grad=True)
    w, b = torch.tensor([0.3, 0.35, 0.4], requires_grad=True), torch.tensor(0.1, requires_grad=True)
    dy = torch.randn(shape)
    grads = [torch.autograd.grad(polykernel.poly_norm(x, w, b, impl="triton"), (x, w, b), dy) for _ in range(2)]
    assert all(torch.equal(a, c) for a, c in zip(*grads))
    for got, want in zip(grads[0], torch.autograd.grad(reference(x, w, b), (x, w, b), dy)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("n", [96, 17000], ids=["tile", "chunked"])
def test_triton_no_grad_forward_matches_autograd_forward(n):
    _need("triton")
    x, w, b = torch.randn(3, n), torch.tensor([0.3, 0.35, 0.4]), torch.tensor(0.1)
    with torch.no_grad():
        y0 = polykernel.poly_norm(x, w, b, impl="triton")
    y1 = polykernel.poly_norm(x.requires_grad_(), w, b, impl="triton")
    assert torch.equal(y0, y1.detach())
    torch.testing.assert_close(y0, reference(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_compile_fullgraph_matches_eager(impl):
    _need(impl)
    torch._dynamo.reset()
    x = torch.randn(3, 16, requires_grad=True)
    w, b = torch.tensor([0.3, 0.35, 0.4], requires_grad=True), torch.tensor(0.1, requires_grad=True)
    compiled = torch.compile(lambda *a: polykernel.poly_norm(*a, impl=impl), fullgraph=True, backend="eager")
    y = compiled(x, w, b)
    dy = torch.randn_like(y)
    want = reference(x, w, b)
    torch.testing.assert_close(y, want)
    for a, c in zip(torch.autograd.grad(y, (x, w, b), dy), torch.autograd.grad(want, (x, w, b), dy)):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "args, kwargs, exc, words",
    [
        ((torch.randn(4, 8), torch.ones(2), torch.tensor(0.0)), {}, OpArgumentError, "'weight'"),
        ((torch.randn(4, 8), torch.ones(1, 3), torch.tensor(0.0)), {}, OpArgumentError, "'weight'"),
        ((torch.randn(4, 8), torch.ones(3).int(), torch.tensor(0.0)), {}, OpTypeError, "'weight'"),
        ((torch.randn(4, 8), torch.ones(3), torch.zeros(2)), {}, OpArgumentError, "'bias'"),
        ((torch.randn(4, 8), torch.ones(3), 0.0), {}, OpTypeError, "'bias'"),
        ((torch.randn(4, 8).int(), torch.ones(3), torch.tensor(0.0)), {}, OpTypeError, "'x'"),
        ((torch.randn(()), torch.ones(3), torch.tensor(0.0)), {}, OpArgumentError, "'x'"),
        ((torch.randn(4, 8), torch.ones(3), torch.tensor(0.0)), {"eps": -1.0}, OpArgumentError, "'eps'"),
        ((torch.randn(4, 8), torch.ones(3, device="meta"), torch.tensor(0.0)), {}, OpArgumentError, "'weight'"),
        ((torch.randn(4, 8), torch.ones(3), torch.tensor(0.0, device="meta")), {}, OpArgumentError, "'bias'"),
    ],
)
def test_bad_input_names_op_and_argument(args, kwargs, exc, words):
    with pytest.raises(exc) as info:
        polykernel.poly_norm(*args, **kwargs)
    assert "norm.poly_norm" in str(info.value) and words in str(info.value)


@pytest.mark.parametrize("impl", IMPLS)
def test_property_parity(impl):
    _need(impl)

    @property_settings(12 if impl != "torch" else 25)
    @given(st.data())
    def run(data):
        dtype = draw_dtype(data)
        lead = data.draw(st.sampled_from([(3,), (0,), (1,), (2, 3), (37,)]), label="lead")
        n = data.draw(st.sampled_from([1, 2, 7, 33, 64, 127, 4099]), label="n")
        scale = data.draw(st.sampled_from([1e-3, 1.0, 30.0]), label="scale")
        x = layout((scale * torch.randn((*lead, n))).to(dtype), data.draw(st.sampled_from(["contiguous", "rows", "cols"]), label="layout"))
        pdtype = data.draw(st.sampled_from([dtype, torch.float32]), label="parameter dtype")
        w = torch.tensor(data.draw(st.sampled_from([(0.3, 0.35, 0.4), (1.0, -1.0, 0.5), (0.0, 0.0, 1.0)]), label="weight")).to(pdtype)
        b = torch.full(data.draw(st.sampled_from([(), (1,)]), label="bias shape"), 0.1).to(pdtype)
        eps = data.draw(st.sampled_from([1e-6, 1e-5]), label="eps")
        grad = data.draw(st.booleans(), label="grad")
        args = tuple(t.requires_grad_(grad) for t in (x, w, b))
        check_case("poly_norm", impl, Case("drawn", args, {"eps": eps}), dtype, grad)

    run()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_parity_gpu_large(dtype):
    assert_parity("poly_norm", device="cuda", dtypes=[dtype], large=True)


def _poly_norm_f64(x, w, b, eps):
    """PolyNorm written out in fp64 (x^6 of any fp32 value fits fp64's range)."""
    x = x.double()

    def norm(u):
        return u / torch.sqrt(u.pow(2).mean(-1, keepdim=True) + eps)

    return w[0] * norm(x**3) + w[1] * norm(x**2) + w[2] * norm(x) + b


@pytest.mark.parametrize("weight", [(1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.0, 0.0, 1.0), (0.7, -0.4, 0.5)], ids=["x3", "x2", "x1", "mixed"])
@pytest.mark.parametrize("n", [40, 17000], ids=["tile", "chunked"])
@pytest.mark.parametrize("eps", [1e-6, 0.0])
@pytest.mark.parametrize("impl", IMPLS)
def test_scale_invariant_for_huge_and_tiny_x(impl, eps, n, weight):
    # The norm is scale-invariant: x⁶ overflowing fp32 (1e42 at |x| = 1e7), or x² underflowing, must
    # not change y or the gradients. Rows of very different magnitudes in one call; in the 4e-8 row
    # eps (1e-6) dominates mean(x⁶), so n_3 = x³/sqrt(eps) is small (~1e-20) but representable.
    # Each row is checked relatively to its own size (bias 0, so that y is the norms alone), down to
    # fp32's smallest normal numbers (the 1e-20 row's n_3 is ~1e-60 for eps > 0: 0 in fp32).
    _need(impl)
    scales = torch.tensor([1e7, 1e20, 1e-20, 4e-8, 0.1, 3e38 / 4])[:, None]
    x = (scales * torch.randn(6, n).clamp(-3.5, 3.5) / 3.5).requires_grad_()
    w = torch.tensor(weight, requires_grad=True)
    b = torch.tensor(0.0, requires_grad=True)
    dy = torch.randn(6, n)
    y = polykernel.poly_norm(x, w, b, eps, impl=impl)
    got = torch.autograd.grad(y, (x, w, b), dy)
    xd = x.detach().double().requires_grad_()
    wd, bd = w.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    yd = _poly_norm_f64(xd, wd, bd, eps)
    want = torch.autograd.grad(yd, (xd, wd, bd), dy.double())
    y_scale = _poly_norm_f64(xd.detach().abs(), wd.detach().abs(), 0.0, eps).amax(-1, keepdim=True)  # Σ|w_p·n_p|
    assert ((y.detach().double() - yd.detach()).abs() <= 1e-4 * y_scale + 1e-37).all()  # 1e-37: fp32's floor
    for g, r in zip(got, want):
        scale = r.abs().amax(-1, keepdim=True) if r.dim() else r.abs()  # dx: per row
        assert torch.isfinite(g).all()
        assert ((g.double() - r).abs() <= 1e-4 * scale + 1e-30).all()
    # one row alone gives the same result as in the batch (the scale is per row)
    torch.testing.assert_close(polykernel.poly_norm(x[1:2].detach(), w.detach(), b.detach(), eps, impl=impl), y[1:2].detach())


@pytest.mark.parametrize("impl", IMPLS)
def test_ordinary_inputs_unchanged_by_the_row_scale(impl):
    # Scaling by a power of two is exact: for inputs with nothing near fp32's range, the result is
    # the unscaled fp32 formula to the bit.
    _need(impl)
    x, w, b = torch.randn(5, 64), torch.tensor([0.3, 0.35, 0.4]), torch.tensor(0.1)

    def norm(u):
        return u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + 1e-6)

    want = w[0] * norm(x.pow(3)) + w[1] * norm(x.pow(2)) + w[2] * norm(x) + b
    got = polykernel.poly_norm(x, w, b, impl=impl)
    if impl == "torch":
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
