"""serving.rms_norm_quant_fp8: rms_norm in fp32 then static e4m3 quantisation, bad input (the fp8
ops' shared checks: test_serving_fp8.py)."""

import pytest
import torch

import polykernel
from _serving_helpers import DTYPES, IMPLS, check_gpu_kernels_store_fp8, need, round_trip_ok
from polykernel.errors import OpArgumentError, OpTypeError
from polykernel.testing import assert_parity

OP = "rms_norm_quant_fp8"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", IMPLS)
def test_parity_cpu(impl, dtype):
    need(OP, impl, dtype)
    assert_parity(OP, [impl], device="cpu", dtypes=[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", IMPLS)
def test_rms_norm_quant_is_rms_norm_then_static_quant(impl, dtype):
    need(OP, impl, dtype)
    x, w = torch.randn(5, 96).to(dtype), (1 + 0.1 * torch.randn(96)).to(dtype)
    scale = torch.tensor([4.0 / 448])
    q = polykernel.rms_norm_quant_fp8(x, w, scale, 1e-5, impl=impl)
    y = polykernel.rms_norm(x.float(), w.float(), 1e-5, impl="torch")  # fp32 all the way: no rounding to x's dtype
    assert round_trip_ok(q, scale, y.clamp(-448 * scale, 448 * scale))


BAD = [
    ("fp16 scale", lambda: (torch.randn(2, 4), torch.ones(4), torch.ones(1, dtype=torch.float16)), {}, OpTypeError, "scale"),
    ("weight shape", lambda: (torch.randn(2, 4), torch.ones(3), torch.ones(1)), {}, OpArgumentError, "weight"),
    ("negative eps", lambda: (torch.randn(2, 4), torch.ones(4), torch.ones(1), -1.0), {}, OpArgumentError, "eps"),
]


@pytest.mark.parametrize("case", BAD, ids=lambda c: c[0])
def test_bad_input_names_the_argument(case):
    _, make, kwargs, error, arg = case
    with pytest.raises(error) as info:
        polykernel.rms_norm_quant_fp8(*make(), **kwargs)
    assert info.value.op == f"serving.{OP}" and info.value.arg == arg


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_parity_gpu_large(dtype):
    assert_parity(OP, device="cuda", dtypes=[dtype], large=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_kernels_store_fp8_themselves():
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
    check_gpu_kernels_store_fp8(OP, (x, w, torch.tensor([0.01], device="cuda")))
