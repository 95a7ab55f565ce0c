"""serving.dynamic_quant_fp8 / static_quant_fp8 / rms_norm_quant_fp8: e4m3 with max 448, scales,
round-trip bounds, the interpreter's fp8 cast, bad input."""

import pytest
import torch

import polykernel
from polykernel.errors import OpArgumentError, OpTypeError
from polykernel.testing import assert_parity, runnable_impls

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
IMPLS = ["torch", "triton"]
OPS = ["dynamic_quant_fp8", "static_quant_fp8", "rms_norm_quant_fp8"]
FP8 = torch.float8_e4m3fn
U8 = 2.0**-4  # e4m3: 3 mantissa bits
TINY8 = 2.0**-10  # half its smallest subnormal


def _need(op, impl, dtype=torch.float32):
    if impl not in runnable_impls(op, "cpu", dtype):
        pytest.skip(f"{impl} not runnable on the CPU here")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op", OPS)
def test_parity_cpu(op, impl, dtype):
    _need(op, impl, dtype)
    assert_parity(op, [impl], device="cpu", dtypes=[dtype])


def _round_trip_ok(q, scale, x):
    """|q·scale - x| <= u8·|x| + 2^-10·scale (+ fp32 slack), elementwise, saturation aside."""
    deq = q.double() * scale.double()
    xd = x.double()
    bound = U8 * xd.abs() + TINY8 * scale.double() + 1e-6 * xd.abs()
    return bool(((deq - xd).abs() <= bound).all())


@pytest.mark.parametrize("per_token", [True, False], ids=["token", "tensor"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", IMPLS)
def test_dynamic_round_trip_and_scale(impl, dtype, per_token):
    _need("dynamic_quant_fp8", impl, dtype)
    x = (torch.randn(6, 300) * torch.logspace(-3, 3, 6)[:, None]).to(dtype)
    x[2] = 0  # the floor
    q, scale = polykernel.dynamic_quant_fp8(x, per_token=per_token, impl=impl)
    assert q.dtype == FP8 and q.shape == x.shape and scale.dtype == torch.float32
    assert scale.shape == ((6, 1) if per_token else (1,))
    amax = x.float().abs().amax(-1, keepdim=True) if per_token else x.float().abs().amax().reshape(1)
    assert torch.equal(scale, (amax / 448).clamp(min=1e-12))  # amax / 448, one fp32 rounding
    assert _round_trip_ok(q, scale, x)
    assert q.float().abs().max() <= 448
    if per_token:
        assert scale[2].item() == pytest.approx(1e-12) and (q[2].float() == 0).all()
        assert torch.equal(q.float().abs().amax(-1), torch.full((6,), 448.0) * (x.float().abs().amax(-1) > 0))


@pytest.mark.parametrize("impl", IMPLS)
def test_static_saturates_and_takes_row_scales(impl):
    _need("static_quant_fp8", impl)
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
    _need("dynamic_quant_fp8", impl)
    x = torch.randn(3, 40)
    x[1, 7] = float("nan")
    q, scale = polykernel.dynamic_quant_fp8(x, impl=impl)
    assert scale[1].isnan() and q[1].float().isnan().all() and not q[[0, 2]].float().isnan().any()
    q, scale = polykernel.dynamic_quant_fp8(x, per_token=False, impl=impl)
    assert scale.isnan().all() and q.float().isnan().all()
    q = polykernel.static_quant_fp8(x, torch.tensor([0.1]), impl=impl)
    assert q.float().isnan().sum() == 1 and q[1, 7].float().isnan()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", IMPLS)
def test_rms_norm_quant_is_rms_norm_then_static_quant(impl, dtype):
    _need("rms_norm_quant_fp8", impl, dtype)
    x, w = torch.randn(5, 96).to(dtype), (1 + 0.1 * torch.randn(96)).to(dtype)
    scale = torch.tensor([4.0 / 448])
    q = polykernel.rms_norm_quant_fp8(x, w, scale, 1e-5, impl=impl)
    y = polykernel.rms_norm(x.float(), w.float(), 1e-5, impl="torch")  # fp32 all the way: no rounding to x's dtype
    assert _round_trip_ok(q, scale, y.clamp(-448 * scale, 448 * scale))


def test_interpreter_workaround_only_on_cpu():
    # On CPU tensors (only ever Triton's interpreter) the kernels store fp32 and torch rounds to
    # e4m3; on the GPU they store e4m3 themselves.
    from polykernel.backends.triton import quant_fp8

    q = torch.empty(3, 8, dtype=FP8)
    target, copy = quant_fp8._target(q, 8)
    assert copy and target.dtype == torch.float32 and target.shape == (3, 8)


@pytest.mark.xfail(
    strict=True,
    reason="Triton 3.9's interpreter rounds fp32 -> float8e4nv wrongly (127.99 -> 64, subnormals truncated); when this passes, drop quant_fp8._target's CPU scratch",
)
def test_interpreter_fp8_store_is_correct():
    import triton
    import triton.language as tl

    @triton.jit
    def store(X, Q, N, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        m = offs < N
        tl.store(Q + offs, tl.load(X + offs, mask=m).to(Q.dtype.element_ty), mask=m)

    x = torch.tensor([127.99, 1.5 * 2**-9, 3 * 2**-10, 300.0, -17.1])
    q = torch.empty(5, dtype=FP8)
    store[(1,)](x, q, 5, BLOCK=8)
    assert torch.equal(q.float(), x.to(FP8).float())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("op", OPS)
def test_gpu_kernels_store_fp8_themselves(op):
    # the one path the CPU cannot run: the kernels' own fp32 -> e4m3 conversion
    if "triton" not in runnable_impls(op, "cuda", torch.bfloat16):
        pytest.skip("Triton fp8 needs sm_89+")
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
    scale = torch.tensor([0.01], device="cuda")
    args = {"dynamic_quant_fp8": (x,), "static_quant_fp8": (x, scale), "rms_norm_quant_fp8": (x, w, scale)}[op]
    fn = getattr(polykernel, op)
    got, want = fn(*args, impl="triton"), fn(*args, impl="torch")
    for g, r in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert (g.float() - r.float()).abs().max() <= (U8 * 2 * r.float().abs() + 2 * TINY8).max()


BAD = [
    ("dynamic_quant_fp8", "integer x", lambda: (torch.ones(2, 4, dtype=torch.int32),), {}, OpTypeError, "x"),
    ("dynamic_quant_fp8", "0-d x", lambda: (torch.tensor(1.0),), {}, OpArgumentError, "x"),
    ("dynamic_quant_fp8", "per_token not a bool", lambda: (torch.randn(2, 4),), {"per_token": 1}, OpTypeError, "per_token"),
    ("dynamic_quant_fp8", "x needs grad", lambda: (torch.randn(2, 4, requires_grad=True),), {}, OpArgumentError, "x"),
    ("static_quant_fp8", "bf16 scale", lambda: (torch.randn(2, 4), torch.tensor([0.1], dtype=torch.bfloat16)), {}, OpTypeError, "scale"),
    ("static_quant_fp8", "fp64 scale", lambda: (torch.randn(2, 4), torch.tensor([0.1], dtype=torch.float64)), {}, OpTypeError, "scale"),
    ("static_quant_fp8", "scale shape", lambda: (torch.randn(2, 4), torch.ones(2)), {}, OpArgumentError, "scale"),
    ("static_quant_fp8", "scale not a tensor", lambda: (torch.randn(2, 4), 0.1), {}, OpTypeError, "scale"),
    ("static_quant_fp8", "scale device", lambda: (torch.randn(2, 4), torch.ones(1, device="meta")), {}, OpArgumentError, "scale"),
    (
        "rms_norm_quant_fp8",
        "fp16 scale",
        lambda: (torch.randn(2, 4), torch.ones(4), torch.ones(1, dtype=torch.float16)),
        {},
        OpTypeError,
        "scale",
    ),
    ("rms_norm_quant_fp8", "weight shape", lambda: (torch.randn(2, 4), torch.ones(3), torch.ones(1)), {}, OpArgumentError, "weight"),
    ("rms_norm_quant_fp8", "negative eps", lambda: (torch.randn(2, 4), torch.ones(4), torch.ones(1), -1.0), {}, OpArgumentError, "eps"),
]


@pytest.mark.parametrize("case", BAD, ids=lambda c: f"{c[0]}-{c[1]}")
def test_bad_input_names_the_argument(case):
    op, _, make, kwargs, error, arg = case
    with pytest.raises(error) as info:
        getattr(polykernel, op)(*make(), **kwargs)
    assert info.value.op == f"serving.{op}" and info.value.arg == arg
