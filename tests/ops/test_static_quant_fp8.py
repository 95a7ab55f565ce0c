"""serving.static_quant_fp8: e4m3 with max 448 by a given scale (per tensor or per row),
saturation, NaN, bad input (the fp8 ops' shared checks: test_serving_fp8.py)."""

import pytest
import torch

import polykernel
from _serving_helpers import DTYPES, FP8, IMPLS, check_gpu_kernels_store_fp8, need
from polykernel.errors import OpArgumentError, OpTypeError
from polykernel.testing import assert_parity

OP = "static_quant_fp8"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", IMPLS)
def test_parity_cpu(impl, dtype):
    need(OP, impl, dtype)
    assert_parity(OP, [impl], device="cpu", dtypes=[dtype])


@pytest.mark.parametrize("impl", IMPLS)
def test_static_saturates_and_takes_row_scales(impl):
    need(OP, impl)
    x = torch.tensor([[1.0, -3.0, 900.0, -1e6, 0.0]])
    q = polykernel.static_quant_fp8(x, torch.tensor([0.5]), impl=impl)
    assert q.float().tolist() == [[2.0, -6.0, 448.0, -448.0, 0.0]]  # clamped, never NaN
    assert polykernel.static_quant_fp8(x, torch.tensor(0.5), impl=impl).float().tolist() == q.float().tolist()  # 0-d scale
    x = torch.randn(4, 50)
    rows = torch.tensor([[0.01], [0.02], [0.5], [1.0]])
    q = polykernel.static_quant_fp8(x, rows, impl=impl)
    assert torch.equal(q.float(), (x / rows).clamp(-448, 448).to(FP8).float())


@pytest.mark.parametrize("impl", IMPLS)
def test_nan_propagates(impl):
    need(OP, impl)
    x = torch.randn(3, 40)
    x[1, 7] = float("nan")
    q = polykernel.static_quant_fp8(x, torch.tensor([0.1]), impl=impl)
    assert q.float().isnan().sum() == 1 and q[1, 7].float().isnan()


BAD = [
    ("bf16 scale", lambda: (torch.randn(2, 4), torch.tensor([0.1], dtype=torch.bfloat16)), {}, OpTypeError, "scale"),
    ("fp64 scale", lambda: (torch.randn(2, 4), torch.tensor([0.1], dtype=torch.float64)), {}, OpTypeError, "scale"),
    ("scale shape", lambda: (torch.randn(2, 4), torch.ones(2)), {}, OpArgumentError, "scale"),
    ("scale not a tensor", lambda: (torch.randn(2, 4), 0.1), {}, OpTypeError, "scale"),
    ("scale device", lambda: (torch.randn(2, 4), torch.ones(1, device="meta")), {}, OpArgumentError, "scale"),
]


@pytest.mark.parametrize("case", BAD, ids=lambda c: c[0])
def test_bad_input_names_the_argument(case):
    _, make, kwargs, error, arg = case
    with pytest.raises(error) as info:
        polykernel.static_quant_fp8(*make(), **kwargs)
    assert info.value.op == f"serving.{OP}" and info.value.arg == arg


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_parity_gpu_large(dtype):
    assert_parity(OP, device="cuda", dtypes=[dtype], large=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_kernels_store_fp8_themselves():
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    check_gpu_kernels_store_fp8(OP, (x, torch.tensor([0.01], device="cuda")))
