"""fused_add_rms_norm: parity of every runnable impl with the reference, the rounded sum, gradients
of one output only, determinism, argument errors."""

import os

import pytest
import torch

import polykernel
from polykernel.errors import OpArgumentError, OpTypeError
from polykernel.ops.fused_add_rms_norm import reference
from polykernel.testing import assert_parity, runnable_impls

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _need(impl, dtype=torch.float32, device="cpu"):
    if impl not in runnable_impls("fused_add_rms_norm", device, dtype):
        pytest.skip(f"{impl} not runnable on {device} here")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_parity_cpu(impl, dtype):
    _need(impl, dtype)
    assert_parity("fused_add_rms_norm", [impl], device="cpu", dtypes=[dtype])


def _sum_is_pytorchs(impl, dtype, device):
    torch.manual_seed(2)
    for n in (300, 16500):  # one-block rows and the chunked path
        # residual >> x: the sum's rounding decides most of its low bits
        x = 0.05 * torch.randn(3, n, device=device).to(dtype)
        r = (20 * torch.randn(3, n, device=device)).to(dtype)
        w = torch.randn(n, device=device).to(dtype)
        y, s = polykernel.fused_add_rms_norm(x, r, w, impl=impl)
        assert s.dtype == dtype and y.dtype == dtype
        assert torch.equal(s, x + r), f"n={n}: s differs from x + residual"
        torch.testing.assert_close(y, polykernel.rms_norm(x + r, w, impl="torch"), rtol=2e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_sum_is_rounded_like_pytorch(impl, dtype):
    _need(impl, dtype)
    if impl == "triton" and dtype == torch.bfloat16 and _INTERPRETED:
        pytest.skip("Triton's CPU interpreter truncates fp32 -> bf16 (the GPU rounds to nearest): checked by the gpu test")
    _sum_is_pytorchs(impl, dtype, "cpu")


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("used", ["y", "s"])
@pytest.mark.parametrize("n", [80, 16500], ids=["tile", "chunked"])
def test_gradient_through_one_output_only(impl, used, n):
    # The other output's gradient is None in the backward: it must count as zero.
    _need(impl)
    torch.manual_seed(3)
    args = [torch.randn(4, n, requires_grad=True), torch.randn(4, n, requires_grad=True), (1 + 0.1 * torch.randn(n)).requires_grad_()]
    ref_args = [a.detach().clone().requires_grad_() for a in args]
    k = 0 if used == "y" else 1
    g = torch.randn(4, n)
    got = torch.autograd.grad(polykernel.fused_add_rms_norm(*args, impl=impl)[k], args, g, allow_unused=True)
    want = torch.autograd.grad(reference(*ref_args)[k], ref_args, g, allow_unused=True)
    for a, b in zip(got, want):
        if b is None:  # d(weight) when only s is used
            assert a is None or torch.count_nonzero(a) == 0
        else:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_float64_uses_torch_and_matches_reference():
    x, r, w = torch.randn(3, 10, dtype=torch.float64), torch.randn(3, 10, dtype=torch.float64), torch.randn(10, dtype=torch.float64)
    assert polykernel.explain("fused_add_rms_norm", x, r, w).chosen == "torch"
    for got, want in zip(polykernel.fused_add_rms_norm(x, r, w), reference(x, r, w)):
        torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)


def test_offset_is_gemmas_one_plus_w():
    x, r, w = torch.randn(4, 32), torch.randn(4, 32), torch.randn(32)
    y, _ = polykernel.fused_add_rms_norm(x, r, w, offset=1.0, impl="torch")
    torch.testing.assert_close(y, polykernel.rms_norm(x + r, 1 + w), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("shape", [(67, 96), (5, 17000)], ids=["tile", "chunked"])
def test_triton_backward_is_deterministic(shape):
    _need("triton")
    x, r = torch.randn(shape, requires_grad=True), torch.randn(shape, requires_grad=True)
    w = torch.randn(shape[1], requires_grad=True)
    gy, gs = torch.randn(shape), torch.randn(shape)
    grads = [torch.autograd.grad(polykernel.fused_add_rms_norm(x, r, w, impl="triton"), (x, r, w), (gy, gs)) for _ in range(2)]
    assert all(torch.equal(a, c) for a, c in zip(*grads))
    assert torch.equal(grads[0][0], grads[0][1])  # x and residual share d(s)
    want = torch.autograd.grad(reference(x, r, w), (x, r, w), (gy, gs))
    for got, ref in zip(grads[0], want):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "args, kwargs, exc, words",
    [
        ((torch.randn(4, 8), torch.randn(4, 7), torch.ones(8)), {}, OpArgumentError, "'residual'"),
        ((torch.randn(4, 8), torch.randn(8), torch.ones(8)), {}, OpArgumentError, "'residual'"),
        ((torch.randn(4, 8), torch.randn(4, 8, dtype=torch.float64), torch.ones(8)), {}, OpTypeError, "'residual'"),
        ((torch.randn(4, 8), [1.0] * 8, torch.ones(8)), {}, OpTypeError, "'residual'"),
        ((torch.randn(4, 8), torch.randn(4, 8, device="meta"), torch.ones(8)), {}, OpArgumentError, "'residual'"),
        ((torch.randn(4, 8), torch.randn(4, 8), torch.ones(7)), {}, OpArgumentError, "'weight'"),
        ((torch.randn(4, 8), torch.randn(4, 8), torch.ones(8, device="meta")), {}, OpArgumentError, "'weight'"),
        ((torch.randn(4, 8), torch.randn(4, 8), torch.ones(8, dtype=torch.int64)), {}, OpTypeError, "'weight'"),
        ((torch.randn(4, 8).int(), torch.randn(4, 8).int(), torch.ones(8)), {}, OpTypeError, "'x'"),
        ((torch.randn(()), torch.randn(()), torch.ones(1)), {}, OpArgumentError, "'x'"),
        ((torch.randn(4, 8), torch.randn(4, 8), torch.ones(8)), {"eps": -1.0}, OpArgumentError, "'eps'"),
        ((torch.randn(4, 8), torch.randn(4, 8), torch.ones(8)), {"offset": float("inf")}, OpArgumentError, "'offset'"),
    ],
)
def test_bad_input_names_op_and_argument(args, kwargs, exc, words):
    with pytest.raises(exc) as info:
        polykernel.fused_add_rms_norm(*args, **kwargs)
    assert "norm.fused_add_rms_norm" in str(info.value) and words in str(info.value)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_parity_gpu_large(dtype):
    assert_parity("fused_add_rms_norm", device="cuda", dtypes=[dtype], large=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sum_is_rounded_like_pytorch_gpu(dtype):
    _need("triton", dtype, "cuda")
    _sum_is_pytorchs("triton", dtype, "cuda")


def test_validation_runs_for_each_new_argument_class():
    # Validation is memoized per argument class: a bad residual after good calls must still fail.
    x, w = torch.randn(4, 8), torch.ones(8)
    polykernel.fused_add_rms_norm(x, torch.randn(4, 8), w)
    polykernel.fused_add_rms_norm(torch.randn(9, 8), torch.randn(9, 8), w)  # new shape, same decision
    assert len(polykernel.core.registry.get_op("fused_add_rms_norm")._memo) == 1
    with pytest.raises(polykernel.OpArgumentError, match="'residual'"):
        polykernel.fused_add_rms_norm(x, torch.randn(4, 9), w)
    with pytest.raises(polykernel.OpTypeError, match="'residual'"):
        polykernel.fused_add_rms_norm(x, torch.randn(4, 8, dtype=torch.float64), w)
