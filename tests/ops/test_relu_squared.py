"""relu_squared: parity of every runnable impl with the reference (fixed and drawn cases), NaN and
layouts, torch.compile, argument errors."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import polykernel
from _property import check_case, draw_dtype, layout, property_settings
from polykernel.core.op import Case
from polykernel.errors import OpArgumentError, OpTypeError
from polykernel.ops.relu_squared import reference
from polykernel.testing import assert_parity, runnable_impls

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
IMPLS = ["torch", "triton"]


def _need(impl, dtype=torch.float32):
    if impl not in runnable_impls("relu_squared", "cpu", dtype):
        pytest.skip(f"{impl} not runnable on the CPU here")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", IMPLS)
def test_parity_cpu(impl, dtype):
    _need(impl, dtype)
    assert_parity("relu_squared", [impl], device="cpu", dtypes=[dtype])


def test_reference_is_relu_squared_of_torch():
    x = torch.randn(5, 9, dtype=torch.float64)
    assert torch.equal(reference(x), F.relu(x) ** 2)
    assert polykernel.explain("relu_squared", x).chosen == "torch"  # fp64: only the torch impl
    assert torch.equal(polykernel.relu_squared(x), reference(x))


@pytest.mark.parametrize("impl", IMPLS)
def test_nan_stays_nan_and_gradients_follow_torch(impl):
    _need(impl)
    x = torch.tensor([float("nan"), float("inf"), float("-inf"), 0.0, -1.0, 2.0], requires_grad=True)
    y = polykernel.relu_squared(x, impl=impl)
    assert torch.isnan(y[0]) and y[1] == float("inf") and torch.equal(y[2:], torch.tensor([0.0, 0.0, 0.0, 4.0]))
    (g,) = torch.autograd.grad(y, x, torch.ones(6))
    assert torch.isnan(g[0]) and g[1] == float("inf") and torch.equal(g[2:], torch.tensor([0.0, 0.0, 0.0, 4.0]))


def test_triton_keeps_a_dense_layout_without_copies():
    _need("triton")
    x = torch.randn(48, 7).t()  # dense, not contiguous
    y = polykernel.relu_squared(x, impl="triton")
    assert y.stride() == x.stride()
    torch.testing.assert_close(y, reference(x), rtol=0, atol=0)


@pytest.mark.parametrize("impl", IMPLS)
def test_backward_saves_only_x(impl):
    _need(impl)
    x = torch.randn(4, 8, requires_grad=True)
    y = polykernel.relu_squared(x, impl=impl)
    assert [t.data_ptr() for t in y.grad_fn.saved_tensors] == [x.data_ptr()]


@pytest.mark.parametrize("impl", IMPLS)
def test_compile_fullgraph_matches_eager(impl):
    _need(impl)
    torch._dynamo.reset()
    x = torch.randn(3, 17, requires_grad=True)
    compiled = torch.compile(lambda t: polykernel.relu_squared(t, impl=impl), fullgraph=True, backend="eager")
    y = compiled(x)
    (g,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(y, reference(x))
    torch.testing.assert_close(g, 2 * F.relu(x.detach()))


@pytest.mark.parametrize(
    "args, exc, words",
    [
        ((torch.randn(4, 8).int(),), OpTypeError, "'x'"),
        (([1.0, 2.0],), OpTypeError, "'x'"),
        ((torch.zeros(3, dtype=torch.bool),), OpTypeError, "'x'"),
    ],
)
def test_bad_input_names_op_and_argument(args, exc, words):
    with pytest.raises(exc) as info:
        polykernel.relu_squared(*args)
    assert "activation.relu_squared" in str(info.value) and words in str(info.value)
    assert isinstance(info.value, OpArgumentError)


@pytest.mark.parametrize("impl", IMPLS)
def test_property_parity(impl):
    _need(impl)

    @property_settings(12 if impl != "torch" else 25)
    @given(st.data())
    def run(data):
        dtype = draw_dtype(data)
        shape = data.draw(st.sampled_from([(), (1,), (0, 5), (3, 7), (2, 3, 33), (5, 4099), (1, 1, 64)]), label="shape")
        scale = data.draw(st.sampled_from([1e-3, 1.0, 30.0]), label="scale")
        x = (scale * torch.randn(shape)).to(dtype)
        special = data.draw(st.sampled_from([None, float("nan"), float("inf"), float("-inf")]), label="special")
        if special is not None and x.numel():
            x.view(-1)[data.draw(st.integers(0, x.numel() - 1), label="at")] = special
        x = layout(x, data.draw(st.sampled_from(["contiguous", "rows", "cols"]), label="layout"))
        grad = data.draw(st.booleans(), label="grad")
        check_case("relu_squared", impl, Case("drawn", (x.requires_grad_(grad),)), dtype, grad)

    run()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_parity_gpu_large(dtype):
    assert_parity("relu_squared", device="cuda", dtypes=[dtype], large=True)
