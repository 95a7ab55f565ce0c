"""layer_norm: parity of every runnable impl with the reference, options, determinism, argument errors."""

import pytest
import torch

import polykernel
from polykernel.errors import OpArgumentError, OpTypeError
from polykernel.ops.layer_norm import reference
from polykernel.testing import assert_parity, runnable_impls

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _need(impl, dtype=torch.float32):
    if impl not in runnable_impls("layer_norm", "cpu", dtype):
        pytest.skip(f"{impl} not runnable on the CPU here")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_parity_cpu(impl, dtype):
    _need(impl, dtype)
    assert_parity("layer_norm", [impl], device="cpu", dtypes=[dtype])


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("n", [3000, 20000], ids=["one-block", "chunked"])
def test_a_constant_row_normalizes_to_zero(impl, n):
    # sum/N misses the mean by the sum's rounding (~1 ulp of 1e4): eps=1e-5 turned that into 0.295
    _need(impl)
    for value in (10000.3, 0.1):
        y = polykernel.layer_norm(torch.full((3, n), value), impl=impl)
        assert y.abs().max().item() == 0.0, (value, y.abs().max().item())


def test_float64_uses_torch_and_matches_reference():
    x, w, b = torch.randn(3, 10, dtype=torch.float64), torch.randn(10, dtype=torch.float64), torch.randn(10, dtype=torch.float64)
    assert polykernel.explain("layer_norm", x, w, b).chosen == "torch"
    torch.testing.assert_close(polykernel.layer_norm(x, w, b), reference(x, w, b), rtol=1e-13, atol=1e-13)


def test_reference_matches_torch_layer_norm():
    # The reference is the contract; check it against PyTorch's definition in fp64.
    x, w, b = torch.randn(5, 37, dtype=torch.float64), torch.randn(37, dtype=torch.float64), torch.randn(37, dtype=torch.float64)
    want = torch.nn.functional.layer_norm(x, (37,), w, b, 1e-3)
    torch.testing.assert_close(reference(x, w, b, 1e-3), want, rtol=1e-12, atol=1e-12)


def test_arg_class_records_which_params_are_present():
    x = torch.randn(4, 8)
    info = polykernel.explain("layer_norm", x, None, torch.zeros(8, dtype=torch.float64)).arg_class
    assert info["weight_dtype"] is None and info["bias_dtype"] == torch.float64 and info["n"] == 8


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("which", ["weight", "bias", "x"])
def test_gradient_of_one_input_only(impl, which):
    # The other inputs do not require grad: the impl must still give this one right.
    _need(impl)
    torch.manual_seed(1)
    args = {"x": torch.randn(6, 50), "weight": 1 + 0.1 * torch.randn(50), "bias": 0.1 * torch.randn(50)}
    args[which].requires_grad_()
    g = torch.randn(6, 50)
    got = torch.autograd.grad(polykernel.layer_norm(args["x"], args["weight"], args["bias"], impl=impl), args[which], g)[0]
    want = torch.autograd.grad(reference(args["x"], args["weight"], args["bias"]), args[which], g)[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("n", [96, 16385], ids=["tile", "chunked"])
def test_triton_no_grad_forward_matches_autograd_forward(n):
    _need("triton")
    x, w, b = torch.randn(3, n), torch.randn(n), torch.randn(n)
    with torch.no_grad():
        y0 = polykernel.layer_norm(x, w, b, impl="triton")
    y1 = polykernel.layer_norm(x.requires_grad_(), w, b, impl="triton")
    assert torch.equal(y0, y1.detach())
    torch.testing.assert_close(y0, reference(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(67, 96), (5, 17000)], ids=["tile", "chunked"])
def test_triton_backward_is_deterministic(shape):
    _need("triton")
    x = torch.randn(shape, requires_grad=True)
    w = torch.randn(shape[1], requires_grad=True)
    b = torch.randn(shape[1], requires_grad=True)
    g = torch.randn(shape)
    grads = [torch.autograd.grad(polykernel.layer_norm(x, w, b, impl="triton"), (x, w, b), g) for _ in range(2)]
    assert all(torch.equal(a, c) for a, c in zip(*grads))
    want = torch.autograd.grad(reference(x, w, b), (x, w, b), g)
    for got, ref in zip(grads[0], want):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "args, kwargs, exc, words",
    [
        ((torch.randn(4, 8), torch.ones(7)), {}, OpArgumentError, "'weight'"),
        ((torch.randn(4, 8), torch.ones(8, 1)), {}, OpArgumentError, "'weight'"),
        ((torch.randn(4, 8), torch.ones(8), torch.zeros(9)), {}, OpArgumentError, "'bias'"),
        ((torch.randn(4, 8), None, torch.zeros(8, dtype=torch.int32)), {}, OpTypeError, "'bias'"),
        ((torch.randn(4, 8), [1.0] * 8), {}, OpTypeError, "'weight'"),
        ((torch.randn(4, 8).int(),), {}, OpTypeError, "'x'"),
        (([1.0, 2.0],), {}, OpTypeError, "'x'"),
        ((torch.randn(()),), {}, OpArgumentError, "'x'"),
        ((torch.randn(4, 8),), {"eps": -1.0}, OpArgumentError, "'eps'"),
        ((torch.randn(4, 8),), {"eps": "1e-5"}, OpArgumentError, "'eps'"),
        ((torch.randn(4, 8), torch.ones(8, device="meta")), {}, OpArgumentError, "'weight'"),
        ((torch.randn(4, 8), None, torch.ones(8, device="meta")), {}, OpArgumentError, "'bias'"),
    ],
)
def test_bad_input_names_op_and_argument(args, kwargs, exc, words):
    with pytest.raises(exc) as info:
        polykernel.layer_norm(*args, **kwargs)
    assert "norm.layer_norm" in str(info.value) and words in str(info.value)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_parity_gpu_large(dtype):
    assert_parity("layer_norm", device="cuda", dtypes=[dtype], large=True)


def test_validation_runs_for_each_new_argument_class():
    x = torch.randn(4, 8)
    polykernel.layer_norm(x, torch.ones(8), torch.zeros(8))
    with pytest.raises(polykernel.OpArgumentError, match="'bias'"):
        polykernel.layer_norm(x, torch.ones(8), torch.zeros(9))
    with pytest.raises(polykernel.OpArgumentError, match="'eps'"):
        polykernel.layer_norm(x, None, None, [1e-5])
