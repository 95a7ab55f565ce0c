"""serving.dynamic_quant_fp8: e4m3 with max 448, amax / 448 scales per token or per tensor,
round-trip bounds, NaN, bad input (the fp8 ops' shared checks: test_serving_fp8.py)."""

import pytest
import torch

import polykernel
from _serving_helpers import DTYPES, FP8, IMPLS, check_gpu_kernels_store_fp8, need, round_trip_ok
from polykernel.errors import OpArgumentError, OpTypeError
from polykernel.testing import assert_parity

OP = "dynamic_quant_fp8"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", IMPLS)
def test_parity_cpu(impl, dtype):
    need(OP, impl, dtype)
    assert_parity(OP, [impl], device="cpu", dtypes=[dtype])


@pytest.mark.parametrize("per_token", [True, False], ids=["token", "tensor"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", IMPLS)
def test_dynamic_round_trip_and_scale(impl, dtype, per_token):
    need(OP, impl, dtype)
    x = (torch.randn(6, 300) * torch.logspace(-3, 3, 6)[:, None]).to(dtype)
    x[2] = 0  # the floor
    q, scale = polykernel.dynamic_quant_fp8(x, per_token=per_token, impl=impl)
    assert q.dtype == FP8 and q.shape == x.shape and scale.dtype == torch.float32
    assert scale.shape == ((6, 1) if per_token else (1,))
    amax = x.float().abs().amax(-1, keepdim=True) if per_token else x.float().abs().amax().reshape(1)
    assert torch.equal(scale, (amax / 448).clamp(min=1e-12))  # amax / 448, one fp32 rounding
    assert round_trip_ok(q, scale, x)
    assert q.float().abs().max() <= 448
    if per_token:
        assert scale[2].item() == pytest.approx(1e-12) and (q[2].float() == 0).all()
        assert torch.equal(q.float().abs().amax(-1), torch.full((6,), 448.0) * (x.float().abs().amax(-1) > 0))


@pytest.mark.parametrize("impl", IMPLS)
def test_nan_propagates(impl):
    need(OP, impl)
    x = torch.randn(3, 40)
    x[1, 7] = float("nan")
    q, scale = polykernel.dynamic_quant_fp8(x, impl=impl)
    assert scale[1].isnan() and q[1].float().isnan().all() and not q[[0, 2]].float().isnan().any()
    q, scale = polykernel.dynamic_quant_fp8(x, per_token=False, impl=impl)
    assert scale.isnan().all() and q.float().isnan().all()


BAD = [
    ("integer x", lambda: (torch.ones(2, 4, dtype=torch.int32),), {}, OpTypeError, "x"),
    ("0-d x", lambda: (torch.tensor(1.0),), {}, OpArgumentError, "x"),
    ("per_token not a bool", lambda: (torch.randn(2, 4),), {"per_token": 1}, OpTypeError, "per_token"),
    ("x needs grad", lambda: (torch.randn(2, 4, requires_grad=True),), {}, OpArgumentError, "x"),
]


@pytest.mark.parametrize("case", BAD, ids=lambda c: c[0])
def test_bad_input_names_the_argument(case):
    _, make, kwargs, error, arg = case
    with pytest.raises(error) as info:
        polykernel.dynamic_quant_fp8(*make(), **kwargs)
    assert info.value.op == f"serving.{OP}" and info.value.arg == arg


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_parity_gpu_large(dtype):
    assert_parity(OP, device="cuda", dtypes=[dtype], large=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_kernels_store_fp8_themselves():
    check_gpu_kernels_store_fp8(OP, (torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16),))
