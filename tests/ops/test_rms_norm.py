"""rms_norm: parity of every runnable impl with the reference, and argument errors."""

import pytest
import torch

import polykernel
from polykernel.errors import OpArgumentError, OpTypeError
from polykernel.testing import assert_parity, runnable_impls

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_parity_cpu(impl, dtype):
    if impl not in runnable_impls("rms_norm", "cpu", dtype):
        pytest.skip(f"{impl} not runnable on the CPU here")
    assert_parity("rms_norm", [impl], device="cpu", dtypes=[dtype])


def test_float64_uses_torch_and_matches_reference():
    x, w = torch.randn(3, 10, dtype=torch.float64), torch.randn(10, dtype=torch.float64)
    assert polykernel.explain("rms_norm", x, w).chosen == "torch"
    from polykernel.ops.rms_norm import reference

    torch.testing.assert_close(polykernel.rms_norm(x, w), reference(x, w), rtol=0, atol=0)


def test_casting_modes_differ_in_bf16():
    # The two castings are different functions: a test that could not tell them apart is useless.
    x = torch.randn(64, 256, dtype=torch.bfloat16)
    w = (1 + torch.randn(256)).to(torch.bfloat16)
    a = polykernel.rms_norm(x, w, casting="fp32", impl="torch")
    b = polykernel.rms_norm(x, w, casting="llama", impl="torch")
    assert not torch.equal(a, b)


@pytest.mark.parametrize(
    "args, kwargs, exc, words",
    [
        ((torch.randn(4, 8), torch.ones(7)), {}, OpArgumentError, "'weight'"),
        ((torch.randn(4, 8), torch.ones(8, 1)), {}, OpArgumentError, "'weight'"),
        ((torch.randn(4, 8).int(), torch.ones(8)), {}, OpTypeError, "'x'"),
        (([1.0, 2.0], torch.ones(2)), {}, OpTypeError, "'x'"),
        ((torch.randn(4, 8), torch.ones(8)), {"eps": -1.0}, OpArgumentError, "'eps'"),
        ((torch.randn(4, 8), torch.ones(8)), {"casting": "bf16"}, OpArgumentError, "'casting'"),
        ((torch.randn(4, 8), torch.ones(8)), {"offset": float("nan")}, OpArgumentError, "'offset'"),
        ((torch.randn(()), torch.ones(1)), {}, OpArgumentError, "'x'"),
        ((torch.randn(4, 8), torch.ones(8, device="meta")), {}, OpArgumentError, "'weight'"),
    ],
)
def test_bad_input_names_op_and_argument(args, kwargs, exc, words):
    with pytest.raises(exc) as info:
        polykernel.rms_norm(*args, **kwargs)
    assert "norm.rms_norm" in str(info.value) and words in str(info.value)


def test_triton_backward_is_deterministic():
    if "triton" not in runnable_impls("rms_norm", "cpu", torch.float32):
        pytest.skip("triton not runnable here")
    x = torch.randn(67, 96, requires_grad=True)
    w = torch.randn(96, requires_grad=True)
    g = torch.randn(67, 96)
    grads = []
    for _ in range(2):
        gx, gw = torch.autograd.grad(polykernel.rms_norm(x, w, impl="triton"), (x, w), g)
        grads.append((gx, gw))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_parity_gpu_large(dtype):
    assert_parity("rms_norm", device="cuda", dtypes=[dtype], large=True)


def test_inline_key_matches_op_key():
    # rms_norm builds its argument class inline for speed; it must equal the op's key function.
    from polykernel.core import registry

    op = registry.get_op("rms_norm")
    x, w = torch.randn(3, 8, requires_grad=True), torch.randn(8)
    polykernel.clear_caches()
    polykernel.rms_norm(x, w, 1e-5, offset=1.0, casting="llama")
    (memo_key,) = op._memo
    assert memo_key[0] == op.key(x, w, 1e-5, offset=1.0, casting="llama")


def test_validation_is_not_skipped_for_a_new_invalid_class():
    x = torch.randn(4, 8)
    polykernel.rms_norm(x, torch.ones(8))
    with pytest.raises(OpArgumentError, match="'weight'"):
        polykernel.rms_norm(x, torch.ones(8, device="meta"))
    with pytest.raises(OpArgumentError, match="'eps'"):
        polykernel.rms_norm(x, torch.ones(8), -1.0)
    with pytest.raises(OpArgumentError, match="'eps'"):  # the same bad class twice: still raises
        polykernel.rms_norm(x, torch.ones(8), -1.0)


def test_unhashable_option_gets_a_named_error_not_a_bare_type_error():
    with pytest.raises(OpArgumentError, match="'eps'"):
        polykernel.rms_norm(torch.randn(4, 8), torch.ones(8), [1e-6])


def test_parity_allows_a_row_with_inf_to_come_back_nan_but_nothing_else():
    # PyTorch's CUDA RMSNorm computes the row statistic in one pass (inf - inf = NaN) and returns
    # NaN across a row holding inf, where the float64 reference is NaN only at the inf (x̂ = x·0
    # elsewhere). The error model allows that for the rows with a non-finite input, no others.
    from polykernel.core.op import Case
    from polykernel.ops.rms_norm import reference
    from polykernel.testing import check_parity

    def whole_row_nan(spread_to_clean_rows: bool):
        def impl(x, weight, eps, offset, casting):
            y = reference(x, weight, eps, offset, casting)
            bad = ~torch.isfinite(x).all(-1, keepdim=True)
            if spread_to_clean_rows:
                bad = bad | torch.zeros_like(bad).index_fill_(0, torch.tensor([2]), True)
            return y.masked_fill(bad, float("nan"))

        return impl

    x = torch.randn(4, 8)
    x[1, 3] = float("inf")
    case = Case("inf", (x, torch.rand(8) + 0.5))
    polykernel.register_impl(op="rms_norm", backend="cuda_jit", rank=1)(whole_row_nan(False))
    (ok,) = check_parity("rms_norm", ["cuda_jit"], dtypes=[torch.float32], cases=[case], backward=False)
    assert ok.ok, str(ok)
    polykernel.register_impl(op="rms_norm", backend="cuda_jit", rank=1)(whole_row_nan(True))  # replaces it
    (bad,) = check_parity("rms_norm", ["cuda_jit"], dtypes=[torch.float32], cases=[case], backward=False)
    assert not bad.ok and "non-finite" in bad.message, str(bad)
