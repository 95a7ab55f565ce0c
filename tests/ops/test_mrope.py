"""mrope: parity of every runnable impl with the reference, the meaning of the sections (against
transformers' formula), the cos/sin-grad predicate, compile, and argument errors."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import polykernel
from _property import check_case, draw_dtype, property_settings
from polykernel.core.op import Case
from polykernel.errors import OpArgumentError, OpTypeError
from polykernel.ops.mrope import _key, cases, example, merge_sections, reference, sections_for
from polykernel.ops.rope import rotate_half
from polykernel.testing import assert_parity, runnable_impls

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
IMPLS = ["torch", "triton"]


def _need(impl, dtype=torch.float32):
    if impl not in runnable_impls("mrope", "cpu", dtype):
        pytest.skip(f"{impl} not runnable on the CPU here")


def hf_mrope(q, k, cos, sin, mrope_section, unsqueeze_dim=1):
    """transformers 4.x's ``apply_multimodal_rotary_pos_emb`` (Qwen2-VL), verbatim in substance."""
    mrope_section = mrope_section * 2
    cos = torch.cat([m[i % 3] for i, m in enumerate(cos.split(mrope_section, dim=-1))], dim=-1).unsqueeze(unsqueeze_dim)
    sin = torch.cat([m[i % 3] for i, m in enumerate(sin.split(mrope_section, dim=-1))], dim=-1).unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", IMPLS)
def test_parity_cpu(impl, dtype):
    _need(impl, dtype)
    assert_parity("mrope", [impl], device="cpu", dtypes=[dtype])


@pytest.mark.parametrize("impl", IMPLS)
def test_matches_transformers_formula(impl):
    _need(impl)
    torch.manual_seed(4)
    q = torch.randn(2, 4, 9, 32, requires_grad=True)
    k = torch.randn(2, 2, 9, 32, requires_grad=True)
    cos, sin = torch.rand(3, 2, 9, 32) * 2 - 1, torch.rand(3, 2, 9, 32) * 2 - 1
    sec = [4, 6, 6]
    want = hf_mrope(q, k, cos, sin, sec)
    got = polykernel.mrope(q, k, cos, sin, sec, impl=impl)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    g = torch.randn_like(q), torch.randn_like(k)
    torch.testing.assert_close(torch.autograd.grad(got, (q, k), g), torch.autograd.grad(want, (q, k), g), atol=1e-6, rtol=1e-6)


def test_sections_pick_their_axis():
    # features of each half: 1 from axis 0, 2 from axis 1, 1 from axis 2
    table = torch.arange(3.0)[:, None, None, None].expand(3, 1, 1, 8)
    assert merge_sections(table, [1, 2, 1]).flatten().tolist() == [0, 1, 1, 2, 0, 1, 1, 2]
    assert sections_for(128) == [16, 24, 24]


def test_torch_gives_table_gradients_and_triton_is_excluded():
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 1, 3, 8)
    cos = torch.rand(3, 1, 3, 8, requires_grad=True)
    sin = torch.rand(3, 1, 3, 8)
    assert "cos/sin require grad" in str(polykernel.explain("mrope", q, k, cos, sin, [1, 2, 1]))
    qr, kr = polykernel.mrope(q, k, cos, sin, [1, 2, 1])
    (dc,) = torch.autograd.grad(qr.sum() + kr.sum(), (cos,))
    want_q, want_k = reference(q, k, cos, sin, [1, 2, 1])
    (wc,) = torch.autograd.grad(want_q.sum() + want_k.sum(), (cos,))
    torch.testing.assert_close(dc, wc)


def test_triton_impl_called_directly_refuses_cos_grad():
    from polykernel.backends.triton.mrope import mrope as triton_mrope

    q = torch.randn(1, 1, 2, 4)
    with pytest.raises(NotImplementedError, match="cos/sin"):
        triton_mrope(q, q, torch.rand(3, 1, 2, 4, requires_grad=True), torch.rand(3, 1, 2, 4), [1, 1, 0])


def test_compiles_fullgraph_forward_and_backward():
    q = torch.randn(2, 4, 5, 16, requires_grad=True)
    k = torch.randn(2, 2, 5, 16, requires_grad=True)
    cos, sin = torch.rand(3, 2, 5, 16), torch.rand(3, 2, 5, 16)
    f = torch.compile(lambda *a: polykernel.mrope(*a, [2, 3, 3]), fullgraph=True, backend="aot_eager")
    got = f(q, k, cos, sin)
    want = reference(q, k, cos, sin, [2, 3, 3])
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    g = torch.autograd.grad(got[0].sum() + (2 * got[1]).sum(), (q, k))
    w = torch.autograd.grad(want[0].sum() + (2 * want[1]).sum(), (q, k))
    torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6)


def test_every_case_has_a_class_that_holds_its_shapes_valid():
    for case in cases("cpu", torch.float32):
        assert _key(*case.args)[-1] is True, case.label
    assert _key(*example((1, 8, 4, 32), torch.float32, "cpu").args)[-1] is True


_q, _k = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8)
_c = torch.randn(3, 1, 5, 8)


@pytest.mark.parametrize(
    "args, exc, words",
    [
        ((_q[0], _k, _c, _c, [1, 2, 1]), OpArgumentError, "'q'"),
        ((_q, _k[0], _c, _c, [1, 2, 1]), OpArgumentError, "'k'"),
        ((_q, _k, _c[0], _c[0], [1, 2, 1]), OpArgumentError, "'cos'"),  # rope's [B, T, D] tables
        ((_q, _k, torch.randn(2, 1, 5, 8), _c, [1, 2, 1]), OpArgumentError, "'cos'"),  # two axes
        ((_q, _k, _c, torch.randn(3, 2, 5, 8), [1, 2, 1]), OpArgumentError, "'sin'"),
        ((_q, _k, _c, _c, [1, 2, 2]), OpArgumentError, "'mrope_section'"),  # sums to 5, not D/2
        ((_q, _k, _c, _c, [2, 2]), OpArgumentError, "'mrope_section'"),
        ((_q, _k, _c, _c, [5, -1, 0]), OpArgumentError, "'mrope_section'"),
        ((_q, _k, _c, _c, [1.0, 2, 1]), OpArgumentError, "'mrope_section'"),
        ((_q, _k, _c, _c, 4), OpArgumentError, "'mrope_section'"),
        ((_q, _k, _c.int(), _c, [1, 2, 1]), OpTypeError, "'cos'"),
    ],
)
def test_bad_input_names_op_and_argument(args, exc, words):
    good = (_q, _k, _c, _c.clone(), [1, 2, 1])
    for _ in range(2):
        polykernel.mrope(*good)
    for _ in range(2):  # rejected on a repeat too
        with pytest.raises(exc) as info:
            polykernel.mrope(*args)
        assert "embedding.mrope" in str(info.value) and words in str(info.value)


@pytest.mark.parametrize("impl", IMPLS)
def test_property_parity(impl):
    _need(impl)

    @property_settings(10 if impl != "torch" else 20)
    @given(st.data())
    def run(data):
        dtype = draw_dtype(data)
        b = data.draw(st.sampled_from([1, 2]), label="B")
        t = data.draw(st.sampled_from([1, 3, 8, 13]), label="T")
        hq, hk = data.draw(st.sampled_from([(1, 1), (4, 2), (6, 1)]), label="heads")
        d = data.draw(st.sampled_from([2, 8, 12, 34]), label="D")
        s0 = data.draw(st.integers(0, d // 2), label="s0")
        s1 = data.draw(st.integers(0, d // 2 - s0), label="s1")
        tb = data.draw(st.sampled_from([1, b]), label="table batch")
        grad = data.draw(st.booleans(), label="grad")
        q = torch.randn(b, hq, t, d).to(dtype).requires_grad_(grad)
        k = torch.randn(b, hk, t, d).to(dtype).requires_grad_(grad)
        cos, sin = ((torch.rand(3, tb, t, d) * 2 - 1).to(dtype) for _ in range(2))
        check_case("mrope", impl, Case("drawn", (q, k, cos, sin, [s0, s1, d // 2 - s0 - s1])), dtype, grad)

    run()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_parity_gpu_large(dtype):
    results = assert_parity("mrope", device="cuda", dtypes=[dtype], large=True)
    assert any(r.impl == "triton" for r in results)
