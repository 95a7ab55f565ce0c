"""rope: parity of every runnable impl with the reference, the cos/sin-grad predicate, layouts,
and argument errors."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import polykernel
from _property import check_case, draw_dtype, property_settings
from polykernel.core.op import Case
from polykernel.errors import ImplNotAvailableError, OpArgumentError, OpTypeError
from polykernel.ops.rope import _key, _rope_tables, bytes_moved, cases, example, reference, rotate_half
from polykernel.testing import assert_parity, check_parity, runnable_impls

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
IMPLS = ["torch", "triton"]


def _need(impl, dtype=torch.float32):
    if impl not in runnable_impls("rope", "cpu", dtype):
        pytest.skip(f"{impl} not runnable on the CPU here")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", IMPLS)
def test_parity_cpu(impl, dtype):
    _need(impl, dtype)
    assert_parity("rope", [impl], device="cpu", dtypes=[dtype])


@pytest.mark.parametrize("rows_min_t", [1, 1 << 30], ids=["rows-kernel", "heads-kernel"])
def test_triton_both_kernels_parity_cpu(rows_min_t, monkeypatch):
    """The Triton impl's two ways to cut the work (a program per head and block of positions, or
    per block of positions with every head), each forced on every case, forward and backward."""
    _need("triton")
    from polykernel.backends.triton import rope as trope

    monkeypatch.setattr(trope, "ROWS_MIN_T", rows_min_t)
    trope._tiles.cache_clear()
    try:
        assert trope._tiles(5, 4, 2, 8).rows == (rows_min_t == 1)
        assert_parity("rope", ["triton"], device="cpu", dtypes=[torch.float32, torch.bfloat16])
    finally:
        trope._tiles.cache_clear()


@pytest.mark.parametrize("impl", IMPLS)
def test_matches_transformers(impl):
    _need(impl)
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    torch.manual_seed(1)
    q, k = torch.randn(2, 8, 19, 64), torch.randn(2, 2, 19, 64)
    cos, sin = _rope_tables(2, 19, 64, torch.float32, "cpu")
    want_q, want_k = llama.apply_rotary_pos_emb(q, k, cos, sin)
    got_q, got_k = polykernel.rope(q, k, cos, sin, impl=impl)
    torch.testing.assert_close(got_q, want_q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_k, want_k, atol=1e-6, rtol=1e-6)


def test_rotation_is_not_identity():
    # The cases would not catch a kernel that ignores the rotation if the reference were wrong too.
    q = torch.tensor([[[[1.0, 2.0, 3.0, 4.0]]]])
    cos = torch.tensor([[[0.0, 0.0, 0.0, 0.0]]])
    sin = torch.tensor([[[1.0, 1.0, 1.0, 1.0]]])
    assert torch.equal(rotate_half(q), torch.tensor([[[[-3.0, -4.0, 1.0, 2.0]]]]))
    q_rot, _ = reference(q, q, cos, sin)
    assert torch.equal(q_rot, torch.tensor([[[[-3.0, -4.0, 1.0, 2.0]]]]))


@pytest.mark.parametrize("impl", IMPLS)
def test_backward_is_rotation_by_minus_sin(impl):
    _need(impl)
    torch.manual_seed(2)
    q = torch.randn(2, 4, 9, 32, requires_grad=True)
    k = torch.randn(2, 2, 9, 32, requires_grad=True)
    cos, sin = _rope_tables(1, 9, 32, torch.float32, "cpu")  # HF tables: equal halves
    gq, gk = torch.randn(2, 4, 9, 32), torch.randn(2, 2, 9, 32)
    dq, dk = torch.autograd.grad(polykernel.rope(q, k, cos, sin, impl=impl), (q, k), (gq, gk))
    with torch.no_grad():
        want_q, want_k = polykernel.rope(gq, gk, cos, -sin, impl="torch")
    torch.testing.assert_close(dq, want_q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(dk, want_k, atol=1e-6, rtol=1e-6)


def _rot_grad_args():
    q, k = torch.randn(2, 4, 5, 16, requires_grad=True), torch.randn(2, 2, 5, 16, requires_grad=True)
    cos, sin = _rope_tables(2, 5, 16, torch.float32, "cpu")
    return q, k, cos.requires_grad_(), sin


def test_cos_requires_grad_excludes_triton():
    q, k, cos, sin = _rot_grad_args()
    info = polykernel.explain("rope", q, k, cos, sin)
    assert info.chosen == "torch"
    row = {r["name"]: r for r in info.impls}["triton"]
    assert not row["runnable"] and "cos/sin require grad" in row["reason"]
    assert "cos/sin require grad" in str(info)
    q_rot, _ = polykernel.rope(q, k, cos, sin)  # auto -> torch: cos gets its gradient
    (g,) = torch.autograd.grad(q_rot.sum(), cos)
    assert g.abs().sum() > 0
    with pytest.raises(ImplNotAvailableError) as exc:
        polykernel.rope(q, k, cos, sin, impl="triton")
    assert "embedding.rope" in str(exc.value) and "cos/sin require grad" in str(exc.value)


def test_sin_requires_grad_excludes_triton_too():
    q, k, cos, sin = _rot_grad_args()
    cos.requires_grad_(False)
    sin.requires_grad_()
    row = {r["name"]: r for r in polykernel.explain("rope", q, k, cos, sin).impls}["triton"]
    assert not row["runnable"] and "cos/sin require grad" in row["reason"]


def test_cos_requires_grad_without_grad_mode_allows_triton():
    _need("triton")
    q, k, cos, sin = _rot_grad_args()
    with torch.no_grad():
        assert polykernel.explain("rope", q, k, cos, sin).chosen == "triton"
        q_rot, k_rot = polykernel.rope(q, k, cos, sin, impl="triton")
        want_q, want_k = reference(q, k, cos, sin)
    torch.testing.assert_close(q_rot, want_q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k_rot, want_k, atol=1e-6, rtol=1e-6)


def test_triton_impl_called_directly_refuses_cos_grad():
    _need("triton")
    from polykernel.backends.triton.rope import rope as triton_rope

    q, k, cos, sin = _rot_grad_args()
    with pytest.raises(NotImplementedError, match="cos/sin"):
        triton_rope(q, k, cos, sin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_torch_impl_gradients_of_cos_and_sin(dtype):
    def t(*shape):
        return torch.randn(shape, dtype=dtype).requires_grad_()

    cases = [
        Case("cos-batch1", (t(2, 4, 6, 16), t(2, 2, 6, 16), t(1, 6, 16), t(1, 6, 16))),
        Case("cos-batchB", (t(3, 2, 5, 8), t(3, 1, 5, 8), t(3, 5, 8), t(3, 5, 8))),
    ]
    assert_parity("rope", ["torch"], device="cpu", dtypes=[dtype], cases=cases)


@pytest.mark.parametrize("impl", IMPLS)
def test_grad_of_one_output_only(impl):
    _need(impl)
    q = torch.randn(2, 4, 7, 16, requires_grad=True)
    k = torch.randn(2, 2, 7, 16, requires_grad=True)
    cos, sin = _rope_tables(1, 7, 16, torch.float32, "cpu")
    q_rot, _ = polykernel.rope(q, k, cos, sin, impl=impl)
    dq, dk = torch.autograd.grad(q_rot.square().sum(), (q, k), allow_unused=True)
    ref_q, _ = reference(q, k, cos, sin)
    want = torch.autograd.grad(ref_q.square().sum(), q)[0]
    torch.testing.assert_close(dq, want, atol=1e-5, rtol=1e-5)
    assert dk is None or torch.count_nonzero(dk) == 0


@pytest.mark.parametrize("impl", IMPLS)
def test_only_k_requires_grad(impl):
    _need(impl)
    q = torch.randn(1, 4, 5, 16)
    k = torch.randn(1, 2, 5, 16, requires_grad=True)
    cos, sin = _rope_tables(1, 5, 16, torch.float32, "cpu")
    _, k_rot = polykernel.rope(q, k, cos, sin, impl=impl)
    g = torch.randn_like(k_rot)
    (dk,) = torch.autograd.grad(k_rot, k, g)
    want = torch.autograd.grad(reference(q, k, cos, sin)[1], k, g)[0]
    torch.testing.assert_close(dk, want, atol=1e-6, rtol=1e-6)


def test_triton_keeps_hf_layout():
    # q/k as HF makes them ([B, T, H*D] -> [B, T, H, D] -> transpose): results and gradients come
    # back in that same layout, so the attention that follows and the projection's backward
    # see no extra copy.
    _need("triton")
    b, t, h, d = 2, 6, 4, 16
    x = torch.randn(b, t, h * d, requires_grad=True)
    q = x.view(b, t, h, d).transpose(1, 2)
    k = q[:, :2]
    cos, sin = _rope_tables(1, t, d, torch.float32, "cpu")
    q_rot, k_rot = polykernel.rope(q, k, cos, sin, impl="triton")
    assert q_rot.stride() == q.stride()
    dq_seen = []
    q.register_hook(lambda g: dq_seen.append(g.stride()))
    (q_rot.sum() + k_rot.sum()).backward()
    assert dq_seen == [q.stride()]
    want_q, want_k = reference(q.detach(), k.detach(), cos, sin)
    torch.testing.assert_close(q_rot, want_q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k_rot, want_k, atol=1e-6, rtol=1e-6)


def test_compiles_fullgraph_forward_and_backward():
    q = torch.randn(2, 4, 5, 16, requires_grad=True)
    k = torch.randn(2, 2, 5, 16, requires_grad=True)
    cos, sin = _rope_tables(1, 5, 16, torch.float32, "cpu")
    f = torch.compile(lambda *a: polykernel.rope(*a), fullgraph=True, backend="aot_eager")
    got = f(q, k, cos, sin)
    want = reference(q, k, cos, sin)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    g = torch.autograd.grad(got[0].sum() + (2 * got[1]).sum(), (q, k))
    w = torch.autograd.grad(want[0].sum() + (2 * want[1]).sum(), (q, k))
    torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6)


def test_float64_uses_torch_and_matches_reference():
    q, k = torch.randn(2, 3, 4, 8, dtype=torch.float64), torch.randn(2, 1, 4, 8, dtype=torch.float64)
    cos, sin = _rope_tables(1, 4, 8, torch.float64, "cpu")
    info = polykernel.explain("rope", q, k, cos, sin)
    assert info.chosen == "torch"
    got = polykernel.rope(q, k, cos, sin)
    want = reference(q, k, cos, sin)
    assert got[0].dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_float64_k_excludes_triton():
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8, dtype=torch.float64)
    cos, sin = _rope_tables(1, 3, 8, torch.float32, "cpu")
    row = {r["name"]: r for r in polykernel.explain("rope", q, k, cos, sin).impls}["triton"]
    assert not row["runnable"] and "float64" in row["reason"]
    q_rot, k_rot = polykernel.rope(q, k, cos, sin)
    assert q_rot.dtype == torch.float32 and k_rot.dtype == torch.float64


def test_example_and_bytes_moved():
    case = example((2, 8, 16, 32), torch.bfloat16, "cpu")
    q, k, cos, sin = case.args
    assert k.shape == (2, 2, 16, 32) and cos.shape == sin.shape == (1, 16, 32)
    fwd = 2 * 2 * (q.numel() + k.numel()) + 2 * 2 * cos.numel()
    assert bytes_moved(*case.args) == fwd
    assert bytes_moved(*case.args, backward=True) == 2 * fwd


def test_every_case_has_a_class_that_holds_its_shapes_valid():
    for case in cases("cpu", torch.float32):
        assert _key(*case.args)[-1] is True, case.label  # args_match


_q, _k = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8)
_c = torch.randn(1, 5, 8)


@pytest.mark.parametrize(
    "args, exc, words",
    [
        ((_q[0], _k, _c, _c), OpArgumentError, "'q'"),
        ((_q, _k[0], _c, _c), OpArgumentError, "'k'"),
        ((_q, torch.randn(3, 2, 5, 8), _c, _c), OpArgumentError, "'k'"),
        ((_q, torch.randn(2, 2, 6, 8), _c, _c), OpArgumentError, "'k'"),
        ((_q, torch.randn(2, 2, 5, 6), _c, _c), OpArgumentError, "'k'"),
        ((torch.randn(2, 4, 5, 7), torch.randn(2, 2, 5, 7), torch.randn(1, 5, 7), torch.randn(1, 5, 7)), OpArgumentError, "'q'"),
        ((torch.randn(2, 4, 5, 0), torch.randn(2, 2, 5, 0), torch.randn(1, 5, 0), torch.randn(1, 5, 0)), OpArgumentError, "'q'"),
        ((_q, _k, torch.randn(5, 8), _c), OpArgumentError, "'cos'"),
        ((_q, _k, torch.randn(3, 5, 8), torch.randn(3, 5, 8)), OpArgumentError, "'cos'"),
        ((_q, _k, torch.randn(1, 4, 8), _c), OpArgumentError, "'cos'"),
        ((_q, _k, torch.randn(1, 5, 10), torch.randn(1, 5, 10)), OpArgumentError, "'cos'"),  # wider than the head
        ((_q, _k, torch.randn(1, 5, 5), torch.randn(1, 5, 5)), OpArgumentError, "'cos'"),  # odd rotary dim
        ((_q, _k, torch.randn(1, 5, 6), _c), OpArgumentError, "'sin'"),  # partial cos, full sin
        ((_q, _k, _c, torch.randn(1, 5, 6)), OpArgumentError, "'sin'"),
        ((_q, _k, _c, torch.randn(2, 5, 8)), OpArgumentError, "'sin'"),
        ((_q.int(), _k, _c, _c), OpTypeError, "'q'"),
        ((_q, _k.int(), _c, _c), OpTypeError, "'k'"),
        ((_q, _k, _c.int(), _c), OpTypeError, "'cos'"),
        ((_q, _k, _c, _c.int()), OpTypeError, "'sin'"),
        (([1.0], _k, _c, _c), OpTypeError, "'q'"),
        ((_q, None, _c, _c), OpTypeError, "'k'"),
        ((_q, _k, _c, _c.numpy()), OpTypeError, "'sin'"),
        ((_q, _k.to("meta"), _c, _c), OpArgumentError, "'k'"),
        ((_q, _k, _c.to("meta"), _c), OpArgumentError, "'cos'"),
        ((_q, _k, _c, _c.to("meta")), OpArgumentError, "'sin'"),
    ],
)
def test_bad_input_names_op_and_argument(args, exc, words):
    good = (_q, _k, _c, _c.clone())
    for _ in range(2):  # a decision and its guard for the valid class of the same dtypes
        polykernel.rope(*good)
    for _ in range(2):  # rejected on a repeat too: the bad call's class is never memoized
        with pytest.raises(exc) as info:
            polykernel.rope(*args)
        assert "embedding.rope" in str(info.value) and words in str(info.value)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_parity_gpu_large(dtype):
    results = assert_parity("rope", device="cuda", dtypes=[dtype], large=True)
    assert any(r.impl == "triton" for r in results)


@pytest.mark.gpu
def test_triton_gpu_hf_layout_and_cos_grad_fallback():
    b, t, h, d = 2, 128, 8, 128
    x = torch.randn(b, t, h * d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    q = x.view(b, t, h, d).transpose(1, 2)
    k = q[:, :2]
    cos, sin = _rope_tables(b, t, d, torch.bfloat16, "cuda")
    assert polykernel.explain("rope", q, k, cos, sin).chosen == "triton"
    q_rot, _ = polykernel.rope(q, k, cos, sin)
    assert q_rot.stride() == q.stride()
    results = check_parity(
        "rope", ["torch"], device="cuda", dtypes=[torch.bfloat16], cases=[Case("cos-grad", (q, k, cos.requires_grad_(), sin))]
    )
    assert all(r.ok for r in results), results
    assert polykernel.explain("rope", q, k, cos, sin).chosen == "torch"


# -- the options: rotary_dim (partial rotary) and interleaved (GPT-J pairs) ---------------------------


@pytest.mark.parametrize("impl", IMPLS)
def test_matches_transformers_glm4_partial_interleaved(impl):
    """GLM4's rotary: interleaved pairs over the first half of each head (HF turns its
    cat(freqs, freqs) tables into repeat_interleave ones; polykernel takes those tables)."""
    _need(impl)
    glm4 = pytest.importorskip("transformers.models.glm4.modeling_glm4")
    torch.manual_seed(3)
    q = torch.randn(2, 4, 7, 32, requires_grad=True)
    k = torch.randn(2, 2, 7, 32, requires_grad=True)
    cos, sin = _rope_tables(2, 7, 16, torch.float32, "cpu")
    want_q, want_k = glm4.apply_rotary_pos_emb(q, k, cos, sin)
    ci, si = (x[..., :8].repeat_interleave(2, dim=-1) for x in (cos, sin))
    got_q, got_k = polykernel.rope(q, k, ci, si, rotary_dim=16, interleaved=True, impl=impl)
    torch.testing.assert_close(got_q, want_q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_k, want_k, atol=1e-6, rtol=1e-6)
    g = torch.randn_like(q), torch.randn_like(k)
    got = torch.autograd.grad((got_q, got_k), (q, k), g)
    want = torch.autograd.grad((want_q, want_k), (q, k), g)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_partial_rotary_passes_the_tail_through_exactly(impl):
    _need(impl)
    q = torch.randn(1, 3, 5, 24, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 1, 5, 24, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = _rope_tables(1, 5, 8, torch.bfloat16, "cpu")
    q_rot, k_rot = polykernel.rope(q, k, cos, sin, impl=impl)
    assert torch.equal(q_rot[..., 8:], q[..., 8:]) and torch.equal(k_rot[..., 8:], k[..., 8:])
    assert not torch.equal(q_rot[..., 1:8], q[..., 1:8])  # the rotary part did rotate
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    dq, dk = torch.autograd.grad((q_rot, k_rot), (q, k), (gq, gk))
    assert torch.equal(dq[..., 8:], gq[..., 8:]) and torch.equal(dk[..., 8:], gk[..., 8:])


def test_interleaved_reference_pairs_neighbours():
    # GPT-J: pairs (x0, x1), (x2, x3); with cos 0 and sin 1 each pair turns by 90 degrees
    q = torch.tensor([[[[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]]]])
    cos = torch.zeros(1, 1, 4)
    sin = torch.ones(1, 1, 4)
    q_rot, _ = reference(q, q, cos, sin, 4, True)
    assert torch.equal(q_rot, torch.tensor([[[[-2.0, 1.0, -4.0, 3.0, 5.0, 6.0]]]]))


@pytest.mark.parametrize("impl", IMPLS)
def test_interleaved_backward_is_rotation_by_minus_sin(impl):
    _need(impl)
    q = torch.randn(2, 4, 6, 16, requires_grad=True)
    k = torch.randn(2, 2, 6, 16, requires_grad=True)
    cos, sin = (x[..., :6].repeat_interleave(2, -1) for x in _rope_tables(1, 6, 12, torch.float32, "cpu"))
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    dq, dk = torch.autograd.grad(polykernel.rope(q, k, cos, sin, interleaved=True, impl=impl), (q, k), (gq, gk))
    with torch.no_grad():
        want_q, want_k = polykernel.rope(gq, gk, cos, -sin, interleaved=True, impl="torch")
    torch.testing.assert_close(dq, want_q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(dk, want_k, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_options_double_backward(impl):
    """create_graph=True through the options (the Triton node differentiates the reference)."""
    _need(impl)
    q = torch.randn(1, 2, 3, 12, dtype=torch.float64 if impl == "torch" else torch.float32, requires_grad=True)
    k = torch.randn(1, 1, 3, 12, dtype=q.dtype, requires_grad=True)
    cos, sin = (torch.rand(1, 3, 8, dtype=q.dtype) for _ in range(2))
    out = polykernel.rope(q, k, cos, sin, rotary_dim=8, interleaved=True, impl=impl)
    (dq,) = torch.autograd.grad(out[0].pow(2).sum() + out[1].sum(), (q,), create_graph=True)
    (ddq,) = torch.autograd.grad(dq.sum(), (q,))
    want = reference(q, k, cos, sin, 8, True)
    (wq,) = torch.autograd.grad(want[0].pow(2).sum() + want[1].sum(), (q,), create_graph=True)
    (wdq,) = torch.autograd.grad(wq.sum(), (q,))
    torch.testing.assert_close(ddq, wdq, atol=1e-5, rtol=1e-5)


def test_options_compile_fullgraph():
    q = torch.randn(2, 4, 5, 16, requires_grad=True)
    k = torch.randn(2, 2, 5, 16, requires_grad=True)
    cos, sin = (torch.rand(1, 5, 8) for _ in range(2))
    f = torch.compile(lambda *a: polykernel.rope(*a, rotary_dim=8, interleaved=True), fullgraph=True, backend="aot_eager")
    got = f(q, k, cos, sin)
    want = reference(q, k, cos, sin, 8, True)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    g = torch.autograd.grad(got[0].sum() + (2 * got[1]).sum(), (q, k))
    w = torch.autograd.grad(want[0].sum() + (2 * want[1]).sum(), (q, k))
    torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6)


def test_cutile_is_excluded_for_the_options():
    from types import SimpleNamespace

    from polykernel.backends.cutile._gates import rope as cutile_predicate

    assert "partial rotary" in cutile_predicate(SimpleNamespace(partial=True, interleaved=False))
    assert "interleaved" in cutile_predicate(SimpleNamespace(partial=False, interleaved=True))


def test_cutile_impl_called_directly_refuses_the_options():
    cutile_rope = pytest.importorskip("polykernel.backends.cutile.rope")
    q = torch.randn(1, 1, 2, 8)
    with pytest.raises(NotImplementedError, match="whole head"):
        cutile_rope.rope(q, q, torch.ones(1, 2, 4), torch.ones(1, 2, 4))
    with pytest.raises(NotImplementedError, match="whole head"):
        cutile_rope.rope(q, q, torch.ones(1, 2, 8), torch.ones(1, 2, 8), None, True)


@pytest.mark.parametrize(
    "kwargs, cos_dim, exc, words",
    [
        ({"rotary_dim": 6}, 8, OpArgumentError, "'rotary_dim'"),  # not cos's width
        ({"rotary_dim": 10}, 8, OpArgumentError, "'rotary_dim'"),  # wider than the head
        ({"rotary_dim": 3}, 8, OpArgumentError, "'rotary_dim'"),
        ({"rotary_dim": 0}, 8, OpArgumentError, "'rotary_dim'"),
        ({"rotary_dim": True}, 8, OpTypeError, "'rotary_dim'"),
        ({"rotary_dim": 4.0}, 4, OpTypeError, "'rotary_dim'"),
        ({"interleaved": 1}, 8, OpTypeError, "'interleaved'"),
        ({"interleaved": "yes"}, 8, OpTypeError, "'interleaved'"),
    ],
)
def test_bad_options_name_op_and_argument(kwargs, cos_dim, exc, words):
    c = torch.randn(1, 5, cos_dim)
    for _ in range(2):  # rejected on a repeat too
        with pytest.raises(exc) as info:
            polykernel.rope(_q, _k, c, c.clone(), **kwargs)
        assert "embedding.rope" in str(info.value) and words in str(info.value)


@pytest.mark.parametrize("impl", IMPLS)
def test_property_parity_options(impl):
    """Drawn shapes with the options: odd T, rotary_dim < D, GQA, a batch-1 or per-batch table,
    HF's transposed layout, forward and backward, against the float64 reference."""
    _need(impl)

    @property_settings(10 if impl != "torch" else 20)
    @given(st.data())
    def run(data):
        dtype = draw_dtype(data)
        b = data.draw(st.sampled_from([1, 2]), label="B")
        t = data.draw(st.sampled_from([1, 3, 8, 13]), label="T")
        hq, hk = data.draw(st.sampled_from([(1, 1), (4, 2), (6, 1), (3, 3)]), label="heads")
        d = data.draw(st.sampled_from([2, 8, 12, 34, 64]), label="D")
        rd = data.draw(st.sampled_from([r for r in range(2, d + 1, 2)]), label="rotary_dim")
        interleaved = data.draw(st.booleans(), label="interleaved")
        tb = data.draw(st.sampled_from([1, b]), label="table batch")
        grad = data.draw(st.booleans(), label="grad")
        hf = data.draw(st.booleans(), label="hf layout")

        def x(h):
            v = torch.randn(b, t, h, d).to(dtype).transpose(1, 2) if hf else torch.randn(b, h, t, d).to(dtype)
            return v.requires_grad_(grad)

        cos, sin = ((torch.rand(tb, t, rd) * 2 - 1).to(dtype) for _ in range(2))
        kwargs = {"interleaved": interleaved} | ({"rotary_dim": rd} if data.draw(st.booleans(), label="explicit") else {})
        check_case("rope", impl, Case("drawn", (x(hq), x(hk), cos, sin), kwargs), dtype, grad)

    run()
