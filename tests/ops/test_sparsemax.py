"""sparsemax: parity of every runnable impl with the reference (fixed and drawn cases), the
simplex and its support, ties, non-finite rows, other dims, torch.compile, argument errors."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import polykernel
from _property import check_case, draw_dtype, layout, property_settings
from polykernel.core.op import Case
from polykernel.errors import OpArgumentError, OpTypeError
from polykernel.ops.sparsemax import reference
from polykernel.testing import assert_parity, runnable_impls

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
IMPLS = ["torch", "triton"]

# the interpreter's numpy warns on -inf - -inf and inf - inf in the rows that come back NaN
pytestmark = [
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
]


def _need(impl, dtype=torch.float32):
    if impl not in runnable_impls("sparsemax", "cpu", dtype):
        pytest.skip(f"{impl} not runnable on the CPU here")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", IMPLS)
def test_parity_cpu(impl, dtype):
    _need(impl, dtype)
    assert_parity("sparsemax", [impl], device="cpu", dtypes=[dtype])


def _projection(z: torch.Tensor) -> torch.Tensor:
    """The Euclidean projection of each row onto the simplex, by bisection on τ (fp64): an
    independent definition of sparsemax to check the reference against."""
    lo, hi = z.max(-1, keepdim=True).values - 1, z.max(-1, keepdim=True).values
    for _ in range(200):
        mid = (lo + hi) / 2
        over = (z - mid).clamp_min(0).sum(-1, keepdim=True) > 1
        lo, hi = torch.where(over, mid, lo), torch.where(over, hi, mid)
    return (z - (lo + hi) / 2).clamp_min(0)


def test_reference_is_the_projection_onto_the_simplex():
    z = 2 * torch.randn(50, 37, dtype=torch.float64)
    y = reference(z)
    torch.testing.assert_close(y, _projection(z), rtol=0, atol=1e-12)
    torch.testing.assert_close(y.sum(-1), torch.ones(50, dtype=torch.float64))
    assert (y == 0).any() and (y >= 0).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_known_values_ties_and_support(impl):
    _need(impl)
    x = torch.tensor([[1.0, 0.8, -1.0], [0.0, 0.0, 0.0], [2.0, 2.0, -5.0], [1.0, 0.0, -1.0]], requires_grad=True)
    y = polykernel.sparsemax(x, impl=impl)
    want = torch.tensor([[0.6, 0.4, 0.0], [1 / 3, 1 / 3, 1 / 3], [0.5, 0.5, 0.0], [1.0, 0.0, 0.0]])
    torch.testing.assert_close(y, want)
    # dx = dy - mean_S(dy) on the support S, 0 elsewhere (the last row: 0 sits exactly at τ, outside S)
    dy = torch.tensor([[1.0, 3.0, 5.0], [1.0, 2.0, 6.0], [2.0, 0.0, 7.0], [4.0, 9.0, 9.0]])
    (g,) = torch.autograd.grad(y, x, dy)
    torch.testing.assert_close(g, torch.tensor([[-1.0, 1.0, 0.0], [-2.0, -1.0, 3.0], [1.0, -1.0, 0.0], [0.0, 0.0, 0.0]]))


@pytest.mark.parametrize("impl", IMPLS)
def test_rows_without_a_finite_maximum_are_nan_with_zero_gradient(impl):
    _need(impl)
    inf = float("inf")
    x = torch.tensor([[-inf, -inf, -inf], [1.0, inf, 0.0], [float("nan"), 0.0, 1.0], [0.0, -inf, 1.0]], requires_grad=True)
    y = polykernel.sparsemax(x, impl=impl)
    assert torch.isnan(y[:3]).all()
    torch.testing.assert_close(y[3], torch.tensor([0.0, 0.0, 1.0]))
    (g,) = torch.autograd.grad(y, x, torch.ones_like(y))
    assert torch.equal(g, torch.zeros_like(g))


@pytest.mark.parametrize("impl", IMPLS)
def test_large_logits_keep_fp32_accuracy(impl):
    # only logits within 1 of the maximum can be in the support: computed on x - max, the result
    # does not lose the digits that 1e6-sized logits would cost x - τ
    _need(impl)
    x = torch.tensor([[0.3, 0.1, -0.25, -2.0]]) + 1e6  # fp32 spacing 0.0625 there: x - τ would be off by that
    y = polykernel.sparsemax(x, impl=impl)
    exact = reference(x.double())  # of the same (rounded) values
    assert (exact > 0).sum() == 3  # a support of three
    torch.testing.assert_close(y.double(), exact, rtol=0, atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dim", [0, 1, -2])
def test_other_dims_match_moving_the_dim_last(impl, dim):
    _need(impl)
    x = torch.randn(6, 5, 7, requires_grad=True)
    dy = torch.randn(6, 5, 7)
    y = polykernel.sparsemax(x, dim, impl=impl)
    (g,) = torch.autograd.grad(y, x, dy)
    xt = x.detach().movedim(dim, -1).requires_grad_()
    yt = polykernel.sparsemax(xt, impl="torch")
    (gt,) = torch.autograd.grad(yt, xt, dy.movedim(dim, -1))
    torch.testing.assert_close(y, yt.movedim(-1, dim))
    torch.testing.assert_close(g, gt.movedim(-1, dim))


@pytest.fixture
def small_blocks(monkeypatch):
    """Shrink the Triton limits so the chunked kernels run on small rows."""
    from polykernel.backends.triton import sparsemax as tsm

    monkeypatch.setattr(tsm, "MAX_FUSED_N", 64)
    monkeypatch.setattr(tsm, "CHUNK_N", 32)
    return tsm


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_chunked_path(small_blocks, dtype):
    _need("triton", dtype)

    def t(*shape, scale=1.0):
        return (scale * torch.randn(shape)).to(dtype).requires_grad_()

    inf = float("inf")
    bad = torch.tensor([[-inf] * 70, [0.0] * 35 + [inf] + [0.0] * 34, [1.0] * 70]).to(dtype).requires_grad_()
    cases = [
        Case("3x300-chunked", (t(3, 300, scale=3.0),)),
        Case("2x1001-odd", (t(2, 1001, scale=0.1),)),  # a wide support: several refinement passes
        Case("2x250-logits-1e4", (t(2, 250, scale=1e4),)),
        Case("3x70-nonfinite", (bad,)),
        Case("5x100-rowstrided", (t(10, 100)[::2],)),
    ]
    assert_parity("sparsemax", ["triton"], device="cpu", dtypes=[dtype], cases=cases)


@pytest.mark.parametrize("impl", IMPLS)
def test_compile_fullgraph_matches_eager(impl):
    _need(impl)
    torch._dynamo.reset()
    x = torch.randn(3, 17, requires_grad=True)
    dy = torch.randn(3, 17)
    compiled = torch.compile(lambda t: polykernel.sparsemax(t, 0, impl=impl), fullgraph=True, backend="eager")
    y = compiled(x)
    (g,) = torch.autograd.grad(y, x, dy)
    x2 = x.detach().clone().requires_grad_()
    y2 = reference(x2, 0)
    (g2,) = torch.autograd.grad(y2, x2, dy)
    torch.testing.assert_close(y, y2)
    torch.testing.assert_close(g, g2)


@pytest.mark.parametrize(
    "args, kwargs, exc, words",
    [
        ((torch.randn(4, 8).int(),), {}, OpTypeError, "'x'"),
        (([1.0, 2.0],), {}, OpTypeError, "'x'"),
        ((torch.tensor(1.0),), {}, OpArgumentError, "'x'"),
        ((torch.randn(4, 8),), {"dim": 2}, OpArgumentError, "'dim'"),
        ((torch.randn(4, 8),), {"dim": -3}, OpArgumentError, "'dim'"),
        ((torch.randn(4, 8),), {"dim": 1.0}, OpTypeError, "'dim'"),
        ((torch.randn(4, 8),), {"dim": True}, OpTypeError, "'dim'"),
    ],
)
def test_bad_input_names_op_and_argument(args, kwargs, exc, words):
    with pytest.raises(exc) as info:
        polykernel.sparsemax(*args, **kwargs)
    assert "activation.sparsemax" in str(info.value) and words in str(info.value)


def test_a_call_along_another_dim_is_its_own_class():
    # the guard holds x's shape and the class holds dim: dim=0 after dim=-1 is decided (and
    # validated) anew, never answered by the last decision
    x = torch.randn(4, 8)
    polykernel.sparsemax(x, impl="torch")
    torch.testing.assert_close(polykernel.sparsemax(x, 0), reference(x, 0))
    with pytest.raises(OpArgumentError, match="'dim'"):
        polykernel.sparsemax(x, 2)


@pytest.mark.parametrize("impl", IMPLS)
def test_property_parity(impl):
    _need(impl)

    @property_settings(12 if impl != "torch" else 25)
    @given(st.data())
    def run(data):
        dtype = draw_dtype(data)
        lead = data.draw(st.sampled_from([(3,), (0,), (1,), (2, 3), (7,)]), label="lead")
        n = data.draw(st.sampled_from([1, 2, 7, 33, 64, 127, 4099]), label="n")
        scale = data.draw(st.sampled_from([1e-3, 1.0, 30.0, 1e4]), label="scale")
        x = (scale * torch.randn((*lead, n))).to(dtype)
        special = data.draw(st.sampled_from([None, float("-inf"), float("inf"), float("nan")]), label="special")
        if special is not None and x.numel():
            x.view(-1)[data.draw(st.integers(0, x.numel() - 1), label="at")] = special
        x = layout(x, data.draw(st.sampled_from(["contiguous", "rows", "cols"]), label="layout"))
        dim = data.draw(st.sampled_from([-1, 0]), label="dim")
        grad = data.draw(st.booleans(), label="grad")
        check_case("sparsemax", impl, Case("drawn", (x.requires_grad_(grad),), {"dim": dim}), dtype, grad)

    run()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_parity_gpu_large(dtype):
    assert_parity("sparsemax", device="cuda", dtypes=[dtype], large=True)
