"""softmax: parity of every runnable impl with the reference, big logits, long rows, argument errors."""

import pytest
import torch

import polykernel
from polykernel.core.op import Case
from polykernel.errors import OpArgumentError, OpTypeError
from polykernel.ops.softmax import reference
from polykernel.testing import assert_parity, runnable_impls

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
IMPLS = ["torch", "triton"]

# the interpreter's numpy warns on exp(-inf - -inf) in rows beyond M (masked, never stored) and
# on -3e38 - 3e38 = -inf (whose exp is the 0 it should be)
pytestmark = [
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
]


def _need(impl, dtype=torch.float32):
    if impl not in runnable_impls("softmax", "cpu", dtype):
        pytest.skip(f"{impl} not runnable on the CPU here")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", IMPLS)
def test_parity_cpu(impl, dtype):
    _need(impl, dtype)
    assert_parity("softmax", [impl], device="cpu", dtypes=[dtype])


def test_float64_uses_torch_and_matches_reference():
    x = torch.randn(3, 10, dtype=torch.float64)
    assert polykernel.explain("softmax", x).chosen == "torch"
    torch.testing.assert_close(polykernel.softmax(x), reference(x), rtol=0, atol=0)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_large_logits_are_stable(impl, dtype):
    _need(impl, dtype)
    x = torch.tensor([[1e4, 1e4 - 1, -1e4, 0.0], [-1e4, -1e4, -1e4, -1e4 + 2], [3e38, 3e38, -3e38, 1.0]])
    x = x.to(dtype).requires_grad_()  # in bf16 1e4 - 1 rounds to 1e4 (spacing 64 there)
    y = polykernel.softmax(x, impl=impl)
    exact = torch.softmax(x.detach().double(), -1)  # of the rounded inputs, in fp64
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y.double(), exact, atol=1e-2 if dtype == torch.bfloat16 else 1e-6, rtol=0)
    (g,) = torch.autograd.grad(y, (x,), torch.randn_like(y))
    assert torch.isfinite(g).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_all_minus_inf_row_is_nan_like_torch(impl):
    _need(impl)
    x = torch.randn(3, 50)
    x[1] = float("-inf")
    y = polykernel.softmax(x, impl=impl)
    assert torch.isnan(y[1]).all() and torch.isfinite(y[[0, 2]]).all()


@pytest.fixture
def small_chunks(monkeypatch):
    """Shrink the Triton limits so the chunked and split paths run on small rows."""
    from polykernel.backends.triton import softmax as tsm

    monkeypatch.setattr(tsm, "MAX_FUSED_N", 64)
    monkeypatch.setattr(tsm, "MAX_FUSED_N_BWD", 64)
    monkeypatch.setattr(tsm, "CHUNK_N", 32)
    monkeypatch.setattr(tsm, "_programs", lambda device: 8)
    return tsm


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_chunked_and_split_paths(small_chunks, dtype):
    # rows < 8 are split across programs (S > 1); 9+ rows take the fused online pass (S == 1)
    _need("triton", dtype)
    assert small_chunks._split(3, 300, torch.device("cpu")) == (3, 4)
    assert small_chunks._split(9, 300, torch.device("cpu"))[0] == 1

    def t(*shape, scale=1.0):
        return (scale * torch.randn(shape)).to(dtype).requires_grad_()

    def masked(m, n, stop):
        x = 3 * torch.randn(m, n)
        x[:, :stop] = float("-inf")  # whole leading chunks of -inf: the online max starts at -inf
        return x.to(dtype).requires_grad_()

    cases = [
        Case("3x300-split", (t(3, 300),)),
        Case("9x300-fused", (t(9, 300),)),
        Case("2x1001-split-odd", (t(2, 1001, scale=5.0),)),
        Case("2x250-logits-1e4", (t(2, 250, scale=1e4),)),
        Case("4x300-masked-split", (masked(4, 300, 100),)),
        Case("9x300-masked-fused", (masked(9, 300, 70),)),
        Case("5x100-rowstrided", (t(10, 100)[::2],)),
    ]
    assert_parity("softmax", ["triton"], device="cpu", dtypes=[dtype], cases=cases)


def test_triton_split_backward_is_deterministic(small_chunks):
    _need("triton")
    x = torch.randn(3, 999, requires_grad=True)
    dy = torch.randn(3, 999)
    a = torch.autograd.grad(polykernel.softmax(x, impl="triton"), (x,), dy)[0]
    b = torch.autograd.grad(polykernel.softmax(x, impl="triton"), (x,), dy)[0]
    assert torch.equal(a, b)


@pytest.mark.parametrize("impl", IMPLS)
def test_bf16_backward_uses_fp32_probabilities(impl):
    # dx from y rounded to bf16 would miss the fp32 reference by far more than one bf16 ulp
    _need(impl, torch.bfloat16)
    torch.manual_seed(3)
    x = (2 * torch.randn(64, 7)).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(64, 7, dtype=torch.bfloat16)
    (g,) = torch.autograd.grad(polykernel.softmax(x, impl=impl), (x,), dy)
    x2 = x.detach().clone().requires_grad_()
    (r,) = torch.autograd.grad(reference(x2), (x2,), dy)
    torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-2)


@pytest.mark.parametrize(
    "args, exc, words",
    [
        ((torch.randn(4, 8).int(),), OpTypeError, "'x'"),
        (([1.0, 2.0],), OpTypeError, "'x'"),
        ((torch.tensor(1.0),), OpArgumentError, "'x'"),
        ((torch.zeros(3, dtype=torch.bool),), OpTypeError, "'x'"),
    ],
)
def test_bad_input_names_op_and_argument(args, exc, words):
    for _ in range(2):  # a decision and its guard for a valid class
        polykernel.softmax(torch.randn(3))
    for _ in range(2):  # rejected on a repeat too: the bad call's class is never memoized
        with pytest.raises(exc) as info:
            polykernel.softmax(*args)
        assert "activation.softmax" in str(info.value) and words in str(info.value)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_parity_gpu_large(dtype):
    assert_parity("softmax", device="cuda", dtypes=[dtype], large=True)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [32768, 262144])
def test_more_than_2_31_elements_gpu(n):
    # row offsets past 2^31 elements must not wrap: one-block forward + chunked backward (32K),
    # chunked forward and backward (256K)
    m = 2**31 // n + 3
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = polykernel.softmax(x, impl="triton")
    dy = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, (x,), dy)
    for rows in (slice(0, 2), slice(m - 3, m)):
        x2 = x[rows].detach().clone().requires_grad_()
        ref = reference(x2)
        (rdx,) = torch.autograd.grad(ref, (x2,), dy[rows])
        torch.testing.assert_close(y[rows], ref, atol=1e-5, rtol=1e-2)
        torch.testing.assert_close(dx[rows], rdx, atol=1e-5, rtol=1e-2)
