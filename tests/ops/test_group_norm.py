"""group_norm: parity of every runnable impl with the reference (fixed and drawn cases), equality
with torch.nn.functional.group_norm, options, determinism, torch.compile, argument errors."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import polykernel
from _property import check_case, draw_dtype, property_settings
from polykernel.core.op import Case
from polykernel.errors import OpArgumentError, OpTypeError
from polykernel.ops.group_norm import reference
from polykernel.testing import assert_parity, runnable_impls

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
IMPLS = ["torch", "triton"]


def _need(impl, dtype=torch.float32):
    if impl not in runnable_impls("group_norm", "cpu", dtype):
        pytest.skip(f"{impl} not runnable on the CPU here")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", IMPLS)
def test_parity_cpu(impl, dtype):
    _need(impl, dtype)
    assert_parity("group_norm", [impl], device="cpu", dtypes=[dtype])


def _args(shape, groups, dtype=torch.float64, affine=True):
    x = torch.randn(shape, dtype=dtype)
    c = shape[1]
    w = (1 + 0.1 * torch.randn(c, dtype=dtype)) if affine else None
    b = (0.1 * torch.randn(c, dtype=dtype)) if affine else None
    return x, groups, w, b


@pytest.mark.parametrize("shape, groups", [((5, 12, 7), 3), ((2, 8, 3, 5), 4), ((3, 6), 6), ((4, 32, 2, 2, 2), 1)])
def test_reference_matches_torch_group_norm(shape, groups):
    # The reference is the contract; check it against PyTorch's definition in fp64.
    x, g, w, b = _args(shape, groups)
    torch.testing.assert_close(reference(x, g, w, b, 1e-3), F.group_norm(x, g, w, b, 1e-3), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(reference(x, g), F.group_norm(x, g), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("affine", [True, False])
def test_equals_torch_group_norm(impl, affine):
    _need(impl)
    x, g, w, b = _args((3, 12, 5, 4), 4, torch.float32, affine)
    grads = [t.requires_grad_() for t in (x, w, b) if t is not None]
    dy = torch.randn(3, 12, 5, 4)
    ours = polykernel.group_norm(x, g, w, b, 1e-5, impl=impl)
    theirs = F.group_norm(x, g, w, b, 1e-5)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    for a, c in zip(torch.autograd.grad(ours, grads, dy), torch.autograd.grad(theirs, grads, dy)):
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_single_value_groups_give_the_bias(impl):
    # F.group_norm refuses N·(C/G)·S = 1 ("more than 1 value per channel"); a group of equal
    # values normalizes to 0, so the output there is the bias
    _need(impl)
    x, b = torch.randn(1, 4, 1), torch.randn(4)
    with pytest.raises(ValueError):
        F.group_norm(x, 4, None, b)
    torch.testing.assert_close(polykernel.group_norm(x, 4, torch.ones(4), b, impl=impl), b.view(1, 4, 1))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("size", [3000, 20000], ids=["one-tile", "tiled"])
@pytest.mark.parametrize("value", [10000.3, 0.1, -7777.77])
def test_a_constant_group_normalizes_to_zero(impl, size, value):
    # sum/n misses the mean by the sum's rounding (~1 ulp of 1e4): eps=1e-5 turned that into 0.295
    _need(impl)
    for eps in (1e-5, 1e-12):
        y = polykernel.group_norm(torch.full((1, 2, size), value), 2, eps=eps, impl=impl)
        assert y.abs().max().item() == 0.0, (eps, y.abs().max().item())


def test_float64_uses_torch_and_matches_reference():
    x, g, w, b = _args((3, 6, 10), 3)
    assert polykernel.explain("group_norm", x, g, w, b).chosen == "torch"
    torch.testing.assert_close(polykernel.group_norm(x, g, w, b), reference(x, g, w, b), rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("which", ["weight", "bias", "x"])
def test_gradient_of_one_input_only(impl, which):
    # The other inputs do not require grad: the impl must still give this one right.
    _need(impl)
    x, g, w, b = _args((4, 6, 25), 2, torch.float32)
    args = {"x": x, "weight": w, "bias": b}
    args[which].requires_grad_()
    dy = torch.randn(4, 6, 25)
    got = torch.autograd.grad(polykernel.group_norm(args["x"], g, args["weight"], args["bias"], impl=impl), args[which], dy)[0]
    want = torch.autograd.grad(reference(args["x"], g, args["weight"], args["bias"]), args[which], dy)[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("shape, groups", [((3, 6, 40), 3), ((2, 4, 9000), 2)], ids=["tile", "chunked"])
def test_triton_no_grad_forward_matches_autograd_forward(shape, groups):
    _need("triton")
    x, g, w, b = _args(shape, groups, torch.float32)
    with torch.no_grad():
        y0 = polykernel.group_norm(x, g, w, b, impl="triton")
    y1 = polykernel.group_norm(x.requires_grad_(), g, w, b, impl="triton")
    assert torch.equal(y0, y1.detach())
    torch.testing.assert_close(y0, reference(x, g, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape, groups", [((9, 6, 40), 3), ((5, 4, 9000), 2)], ids=["tile", "chunked"])
def test_triton_backward_is_deterministic(shape, groups):
    _need("triton")
    x, g, w, b = _args(shape, groups, torch.float32)
    x, w, b = (t.requires_grad_() for t in (x, w, b))
    dy = torch.randn(shape)
    grads = [torch.autograd.grad(polykernel.group_norm(x, g, w, b, impl="triton"), (x, w, b), dy) for _ in range(2)]
    assert all(torch.equal(a, c) for a, c in zip(*grads))
    for got, want in zip(grads[0], torch.autograd.grad(reference(x, g, w, b), (x, w, b), dy)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("impl", IMPLS)
def test_compile_fullgraph_matches_eager(impl):
    _need(impl)
    torch._dynamo.reset()
    x, g, w, b = _args((2, 6, 5), 3, torch.float32)
    x, w, b = (t.requires_grad_() for t in (x, w, b))
    compiled = torch.compile(lambda *a: polykernel.group_norm(*a, impl=impl), fullgraph=True, backend="eager")
    y = compiled(x, g, w, b)
    dy = torch.randn_like(y)
    want = reference(x, g, w, b)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    for a, c in zip(torch.autograd.grad(y, (x, w, b), dy), torch.autograd.grad(want, (x, w, b), dy)):
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "args, kwargs, exc, words",
    [
        ((torch.randn(2, 6, 4), 4), {}, OpArgumentError, "'num_groups'"),  # 4 does not divide 6
        ((torch.randn(2, 6, 4), 0), {}, OpArgumentError, "'num_groups'"),
        ((torch.randn(2, 6, 4), 2.0), {}, OpTypeError, "'num_groups'"),
        ((torch.randn(2, 6, 4), True), {}, OpTypeError, "'num_groups'"),
        ((torch.randn(2, 6, 4), 3, torch.ones(4)), {}, OpArgumentError, "'weight'"),
        ((torch.randn(2, 6, 4), 3, torch.ones(6, 1)), {}, OpArgumentError, "'weight'"),
        ((torch.randn(2, 6, 4), 3, None, torch.zeros(7)), {}, OpArgumentError, "'bias'"),
        ((torch.randn(2, 6, 4), 3, torch.ones(6, dtype=torch.int32)), {}, OpTypeError, "'weight'"),
        ((torch.randn(2, 6, 4), 3, [1.0] * 6), {}, OpTypeError, "'weight'"),
        ((torch.randn(2, 6, 4).int(), 3), {}, OpTypeError, "'x'"),
        ((torch.randn(6), 3), {}, OpArgumentError, "'x'"),  # needs [N, C, *]
        (([1.0, 2.0], 1), {}, OpTypeError, "'x'"),
        ((torch.randn(2, 6, 4), 3), {"eps": -1.0}, OpArgumentError, "'eps'"),
        ((torch.randn(2, 6, 4), 3, torch.ones(6, device="meta")), {}, OpArgumentError, "'weight'"),
        ((torch.randn(2, 6, 4), 3, None, torch.ones(6, device="meta")), {}, OpArgumentError, "'bias'"),
    ],
)
def test_bad_input_names_op_and_argument(args, kwargs, exc, words):
    with pytest.raises(exc) as info:
        polykernel.group_norm(*args, **kwargs)
    assert "norm.group_norm" in str(info.value) and words in str(info.value)


def test_validation_runs_for_each_new_argument_class():
    x = torch.randn(2, 6, 4)
    polykernel.group_norm(x, 3, torch.ones(6), torch.zeros(6))
    with pytest.raises(OpArgumentError, match="'num_groups'"):
        polykernel.group_norm(x, 4, torch.ones(6), torch.zeros(6))
    with pytest.raises(OpArgumentError, match="'num_groups'"):  # another x, the same groups
        polykernel.group_norm(torch.randn(2, 8, 4), 3)
    with pytest.raises(OpArgumentError, match="'eps'"):
        polykernel.group_norm(x, 3, None, None, [1e-5])


@pytest.mark.parametrize("impl", IMPLS)
def test_property_parity(impl):
    _need(impl)

    @property_settings(12 if impl != "torch" else 25)
    @given(st.data())
    def run(data):
        dtype = draw_dtype(data)
        n = data.draw(st.sampled_from([0, 1, 2, 5]), label="n")
        groups = data.draw(st.sampled_from([1, 2, 3]), label="groups")
        c = groups * data.draw(st.sampled_from([1, 2, 5]), label="channels per group")
        spatial = data.draw(st.sampled_from([(), (1,), (7,), (3, 5), (130,)]), label="spatial")
        scale = data.draw(st.sampled_from([1e-3, 1.0, 30.0]), label="scale")
        shift = data.draw(st.sampled_from([0.0, 0.0, 20.0]), label="shift")
        x = (scale * torch.randn((n, c, *spatial)) + shift).to(dtype)
        if data.draw(st.booleans(), label="channels last") and x.dim() == 4:
            x = x.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
        pdtype = data.draw(st.sampled_from([dtype, torch.float32]), label="parameter dtype")
        w = (1 + 0.1 * torch.randn(c)).to(pdtype) if data.draw(st.booleans(), label="weight") else None
        b = (0.1 * torch.randn(c)).to(pdtype) if data.draw(st.booleans(), label="bias") else None
        grad = data.draw(st.booleans(), label="grad")
        args = tuple(t.requires_grad_(grad) if isinstance(t, torch.Tensor) else t for t in (x, groups, w, b))
        check_case("group_norm", impl, Case("drawn", args), dtype, grad)

    run()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_parity_gpu_large(dtype):
    assert_parity("group_norm", device="cuda", dtypes=[dtype], large=True)
