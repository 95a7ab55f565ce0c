"""moe.moe_experts: parity of every runnable impl with the reference (and the reference with a
per-token loop), awkward routings, deterministic mode, argument errors, torch.compile with the
router, the module, FLOPs and bytes (the router's own checks: test_moe_router.py). The Triton impl
runs through the CPU interpreter at tiny shapes."""

import functools

import pytest
import torch

import _moe_helpers as moe
import polykernel
import polykernel.nn as pnn
from polykernel import _compat
from polykernel.backends import _moe_experts, _moe_route
from polykernel.backends.torch import moe_experts as torch_moe
from polykernel.errors import OpArgumentError, OpTypeError
from polykernel.ops import moe_experts as op
from polykernel.testing import assert_parity, runnable_impls

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
IMPLS = ["torch", "triton"]

# the interpreter's numpy exp overflows (harmlessly, to inf) in sigmoid for very negative inputs
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


_need = functools.partial(moe.need, "moe_experts")
_case = functools.partial(moe.case, op)
_f64 = moe.f64


def per_token(hidden, index, weights, gate_up, down, activation="silu"):
    """The contract's formula, literally: one token and one of its k slots at a time."""
    inter = gate_up.shape[1] // 2
    rows = []
    for t in range(hidden.shape[0]):
        x, acc = hidden[t], 0
        for j in range(index.shape[1]):
            e = int(index[t, j])
            g, u = gate_up[e, :inter] @ x, gate_up[e, inter:] @ x
            acc = acc + weights[t, j] * (down[e] @ (op.activate(g, activation) * u))
        rows.append(acc if torch.is_tensor(acc) else torch.zeros_like(x))
    return torch.stack(rows) if rows else hidden.new_zeros(hidden.shape)


def _grads(out, args, dy):
    leaves = [args[i] for i in (0, 2, 3, 4)]
    return torch.autograd.grad(out, leaves, dy)


# ---------------------------------------------------------------------------------------------
# parity


@pytest.mark.slow  # 5-12 s a dtype: the op's cases through Triton's interpreter and a float64 reference
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", IMPLS)
def test_parity_cpu(impl, dtype):
    _need(impl, dtype)
    assert_parity("moe_experts", [impl], device="cpu", dtypes=[dtype])


def test_reference_is_the_per_token_formula():
    moe.reference_is_the_per_token_formula(op, per_token, (0, 2, 3, 4))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("label", ["13x24x40-E5-k2", "12x24x40-E8-k2-empty-experts", "20x24x40-E5-k1-skew90", "1x24x40-E5-k1"])
def test_every_gradient_against_the_per_token_formula(impl, label):
    # the impl in fp32 against the literal formula in fp64, within the op's error model
    _need(impl)
    fn = functools.partial(polykernel.moe_experts, impl=impl)
    moe.every_gradient_within_the_error_model(fn, op, _case(label), per_token, (0, 2, 3, 4))


@pytest.mark.parametrize("impl", IMPLS)
def test_unused_experts_get_exactly_zero_gradients(impl):
    _need(impl)
    hidden, index, weights, gate_up, down = _case("12x24x40-E8-k2-empty-experts").args
    out = polykernel.moe_experts(hidden, index, weights, gate_up, down, impl=impl)
    d_gate_up, d_down = torch.autograd.grad(out, (gate_up, down), torch.randn_like(out))
    unused = [e for e in range(8) if e not in (1, 6)]
    assert d_gate_up[unused].count_nonzero() == 0 and d_down[unused].count_nonzero() == 0
    assert d_gate_up[[1, 6]].count_nonzero() > 0 and d_down[[1, 6]].count_nonzero() > 0


def test_float64_uses_torch_and_matches_the_reference():
    args = _f64(_case("13x24x40-E5-k2").args)
    assert polykernel.explain("moe_experts", *args).chosen == "torch"
    torch.testing.assert_close(polykernel.moe_experts(*args), op.reference(*args), rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# the torch impl's paths


def test_torch_grouped_mm_and_the_expert_loop_agree(monkeypatch):
    args = [a.detach() for a in _case("13x24x40-E5-k2").args]
    if torch_moe.grouped_mm_refusal(args[0], args[3], args[4]) is not None:
        pytest.skip("torch._grouped_mm does not run here")
    grouped = torch_moe.moe_experts(*args, "silu")
    monkeypatch.setattr(torch_moe, "grouped_mm_refusal", lambda *a: "forced")
    looped = torch_moe.moe_experts(*args, "silu")
    torch.testing.assert_close(grouped, looped, rtol=1e-5, atol=1e-6)


def test_torch_grouped_mm_refusals_give_reasons():
    x, g, d = torch.randn(4, 17), torch.randn(3, 46, 17), torch.randn(3, 17, 23)
    if _compat.grouped_mm is None:  # (POLYKERNEL_COMPAT_FALLBACKS=1, or an older torch)
        assert "no torch._grouped_mm" in torch_moe.grouped_mm_refusal(x, g, d)
        return
    assert "16 bytes" in torch_moe.grouped_mm_refusal(x, g, d)
    assert "fp32/bf16/fp16" in torch_moe.grouped_mm_refusal(x.double(), g.double(), d.double())
    x, g, d = torch.randn(4, 16), torch.randn(3, 48, 16), torch.randn(3, 16, 24)
    with moe.deterministic():
        assert "deterministic" in torch_moe.grouped_mm_refusal(x, g, d)
    assert "contiguous" in torch_moe.grouped_mm_refusal(x, g.transpose(1, 2).contiguous().transpose(1, 2), d)


def test_torch_impl_under_graph_capture_without_grouped_mm_runs_the_reference(monkeypatch):
    # no host sync is possible while a CUDA graph is captured: the loop's offsets.tolist() must not run
    args = [a.detach() for a in _case("9x17x23-E3-k2-odd").args]  # odd sizes: no grouped_mm
    calls = []
    monkeypatch.setattr(torch_moe, "reference", lambda *a: calls.append(1) or op.reference(*a))
    monkeypatch.setattr(_moe_experts, "_looped", lambda *a: pytest.fail("the loop syncs"))
    monkeypatch.setattr(torch_moe, "capturing", lambda t: True)
    torch_moe.moe_experts(*args, "silu")
    assert calls == [1]


# ---------------------------------------------------------------------------------------------
# the sort and the Triton tile table


def test_the_device_side_range_check_catches_every_bad_index():
    # off the CPU the index values are checked on the device: offsets[0] and S - offsets[E] count
    # the pairs below 0 and at or above E. Forced here on the CPU, where _assert_async raises now.
    for bad in (torch.tensor([[0, 5]]), torch.tensor([[-1, 2]]), torch.tensor([[7], [1]], dtype=torch.int32)):
        with pytest.raises(RuntimeError, match="outside"):
            _moe_route.sort_by_expert(bad, 5, device_check=True)
    _moe_route.sort_by_expert(torch.tensor([[0, 4], [4, 0]]), 5, device_check=True)


def test_the_sort_rejects_a_bad_index_on_the_cpu_for_calls_past_the_public_check():
    # a DTensor's local shards and a compiled graph's custom op reach the impls without the
    # public function's per-call check: on the CPU the sort reads the sorted ids' ends
    for bad, shown in ((torch.tensor([[0, 5]]), "5"), (torch.tensor([[-2, 2]]), "-2")):
        with pytest.raises(OpArgumentError, match=f"'top_k_index': expert index {shown} is out of range"):
            _moe_route.sort_by_expert(bad, 5)
    args = _good()
    args[1] = torch.tensor([[0, 3], [1, 2], [0, 1], [2, 0]])
    with pytest.raises(OpArgumentError, match=r"moe\.moe_experts"):  # the impl itself, called past validation
        torch_moe.moe_experts(*args, "silu")


def test_sort_is_stable_and_offsets_bound_each_expert():
    index = torch.tensor([[2, 0], [2, 1], [0, 2], [4, 1]])
    perm, offsets = _moe_route.sort_by_expert(index, 6)
    assert perm.tolist() == [1, 4, 3, 7, 0, 2, 5, 6]
    assert offsets.tolist() == [0, 2, 4, 7, 7, 8, 8]
    assert _moe_route.inverse(perm)[perm].tolist() == list(range(8))


@pytest.mark.parametrize("bm", [16, 64])
def test_triton_tiles_cover_each_expert_exactly_once(bm):
    pytest.importorskip("triton")
    from polykernel.backends.triton import _grouped as tri

    for seed, (t, k, e) in enumerate([(13, 2, 5), (100, 1, 3), (1, 1, 1), (40, 4, 16), (70, 2, 2)]):
        g = torch.Generator().manual_seed(seed)
        index = torch.randint(0, e, (t, k), generator=g)
        index[: t // 2] = e - 1  # skewed
        rt = tri.route(index, e, bm)
        offsets = rt.offsets.tolist()
        seen = []
        for p in range(rt.tiles):
            ex, r0 = int(rt.tile_e[p]), int(rt.tile_r0[p])
            rows = [r for r in range(r0, r0 + bm) if r < offsets[ex + 1]]
            assert all(r >= offsets[ex] for r in rows)
            seen += rows
        assert sorted(seen) == list(range(t * k))


def test_triton_tile_sizes_are_a_host_decision():
    pytest.importorskip("triton")
    from polykernel.backends.triton import _grouped as tri

    small = tri.plan(26, 5, 24, 40, 4, True)
    assert small.bm == 16 and max(small.bn, small.bk) <= 32  # the interpreter: tl.dot's minimum
    assert tri.plan(8192 * 8, 128, 2048, 768, 2, False).bm == 128 and tri.plan(8192 * 2, 128, 2048, 768, 2, False).bm == 64


# ---------------------------------------------------------------------------------------------
# determinism, double backward, inference


@pytest.mark.parametrize("impl", IMPLS)
def test_deterministic_mode_gives_the_same_bits_twice(impl):
    _need(impl)
    args = _case("20x24x40-E5-k1-skew90").args

    def run():
        fresh = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
        out = polykernel.moe_experts(*fresh, impl=impl)
        return (out, *_grads(out, fresh, torch.ones_like(out)))

    with moe.deterministic():
        first, second = run(), run()
        assert polykernel.explain("moe_experts", *args, impl=impl).chosen == impl  # eligible in deterministic mode
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_triton_double_backward_matches_the_reference():
    _need("triton")
    hidden, index, weights, gate_up, down = (a.detach().clone().requires_grad_(a.requires_grad) for a in _case("6x16x24-E1-k1").args)

    def second_order(impl):
        fn = op.reference if impl is None else lambda *a: polykernel.moe_experts(*a, impl=impl)
        out = fn(hidden, index, weights, gate_up, down)
        (dx,) = torch.autograd.grad(out, hidden, torch.ones_like(out), create_graph=True)
        return torch.autograd.grad(dx.pow(2).sum(), (weights, down))

    for a, b in zip(second_order("triton"), second_order(None)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_no_grad_and_partial_grad(impl):
    _need(impl)
    hidden, index, weights, gate_up, down = (a.detach() for a in _case("13x24x40-E5-k2").args)
    with torch.no_grad():
        ref = polykernel.moe_experts(hidden, index, weights, gate_up, down, impl=impl)
    assert ref.grad_fn is None
    down.requires_grad_()
    out = polykernel.moe_experts(hidden, index, weights, gate_up, down, impl=impl)
    (d_down,) = torch.autograd.grad(out, (down,), torch.ones_like(out))
    d2 = down.detach().clone().requires_grad_()
    (want,) = torch.autograd.grad(op.reference(hidden, index, weights, gate_up, d2), (d2,), torch.ones_like(out))
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(d_down, want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# bad input


def _good(t=4, h=8, inter=6, e=3, k=2):
    index = torch.tensor([[0, 2], [1, 2], [0, 1], [2, 0]])[:t, :k]
    return [torch.randn(t, h), index, torch.rand(t, k), torch.randn(e, 2 * inter, h), torch.randn(e, h, inter)]


def _with(i, value):
    args = _good()
    args[i] = value
    return args


@pytest.mark.parametrize(
    "args, kw, exc, words",
    [
        *moe.bad_routing_and_hidden(_with),
        (_with(4, torch.randn(4, 8, 6)), {}, OpArgumentError, "'down_proj'"),  # E = 4 vs gate_up's 3
        (_with(4, torch.randn(3, 8, 5)), {}, OpArgumentError, "'down_proj'"),  # I
        (_with(3, torch.randn(3, 11, 8)), {}, OpArgumentError, "'gate_up_proj'"),  # 2I odd
        (_with(3, torch.randn(3, 12, 9)), {}, OpArgumentError, "'gate_up_proj'"),  # H
        (_with(2, torch.rand(4)), {}, OpArgumentError, "'top_k_weights'"),
        (_with(1, torch.tensor([[0], [1], [2], [0]])), {}, OpArgumentError, "'top_k_weights'"),  # index k = 1, weights k = 2
        (_with(1, torch.zeros(3, 2, dtype=torch.long)), {}, OpArgumentError, "'top_k_index'"),  # T mismatch
        (_with(1, torch.zeros(4, 0, dtype=torch.long)), {}, OpArgumentError, "'top_k_index'"),  # k = 0
        (_with(3, torch.randn(3, 12, 8, dtype=torch.float64)), {}, OpTypeError, "'gate_up_proj'"),
        (_with(2, torch.rand(4, 2, dtype=torch.float16)), {}, OpTypeError, "'top_k_weights'"),
        (_with(4, torch.randn(3, 8, 6, device="meta")), {}, OpArgumentError, "'down_proj'"),
        (_with(0, [[1.0] * 8] * 4), {}, OpTypeError, "'hidden'"),
        (_good(), {"activation": "relu"}, OpArgumentError, "'activation'"),
    ],
)
def test_bad_input_names_op_and_argument(args, kw, exc, words):
    with pytest.raises(exc) as info:
        polykernel.moe_experts(*args, **kw)
    assert "moe.moe_experts" in str(info.value) and words in str(info.value)


def test_bad_index_is_caught_before_any_kernel_and_marks_nothing_broken():
    _need("triton")
    args = _good()
    bad = _with(1, torch.tensor([[0, 9], [1, 2], [0, 1], [2, 0]]))
    with pytest.raises(OpArgumentError):
        polykernel.moe_experts(*bad, impl="triton")
    polykernel.moe_experts(*args)
    with pytest.raises(OpArgumentError):  # also on a repeat of a valid call's class (the index values are not in it)
        polykernel.moe_experts(*bad)
    assert polykernel.explain("moe_experts", *args).chosen == "triton"


# ---------------------------------------------------------------------------------------------
# torch.compile, the module


def test_compile_fullgraph_router_and_experts():
    torch._dynamo.reset()
    hidden, _, _, gate_up, down = _good()
    hidden, gate_up, down = (a.requires_grad_() for a in (hidden, gate_up, down))
    logits = torch.randn(4, 3, requires_grad=True)

    def layer(x, logits, gate_up, down):
        weights, index = polykernel.moe_router(logits, 2)
        return polykernel.moe_experts(x, index, weights, gate_up, down)

    compiled = torch.compile(layer, fullgraph=True, backend="eager")
    out = compiled(hidden, logits, gate_up, down)
    got = torch.autograd.grad(out.sum(), (hidden, logits, gate_up, down))
    want_out = layer(hidden, logits, gate_up, down)
    want = torch.autograd.grad(want_out.sum(), (hidden, logits, gate_up, down))
    torch.testing.assert_close(out, want_out)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    torch._dynamo.reset()


def test_module_matches_the_op_and_loads_transformers_names():
    experts = pnn.MoEExperts(4, 16, 24, impl="torch")
    assert set(experts.state_dict()) == {"gate_up_proj", "down_proj"}
    assert experts.gate_up_proj.shape == (4, 48, 16) and experts.down_proj.shape == (4, 16, 24)
    x = torch.randn(2, 3, 16)
    weights, index = polykernel.moe_router(torch.randn(2, 3, 4), 2)
    out = experts(x, index, weights)
    want = op.reference(x.view(6, 16), index.view(6, 2), weights.view(6, 2), experts.gate_up_proj, experts.down_proj)
    torch.testing.assert_close(out, want.view(2, 3, 16))
    with pytest.raises(ValueError, match="activation"):
        pnn.MoEExperts(4, 16, 24, activation="relu")
    assert "num_experts=4" in repr(experts) and "impl='torch'" in repr(experts)


def test_module_matches_transformers_qwen3_moe_experts():
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = transformers.Qwen3MoeConfig(hidden_size=16, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2)
    theirs = Qwen3MoeExperts(config)
    ours = pnn.MoEExperts(4, 16, 24)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(7, 16)
    weights, index = polykernel.moe_router(torch.randn(7, 4), 2)
    with torch.no_grad():
        torch.testing.assert_close(ours(x, index, weights), theirs(x, index, weights), rtol=1e-5, atol=1e-6)


def test_flops_and_bytes():
    hidden, index, weights, gate_up, down = _good()
    assert op.flops(hidden, index, weights, gate_up) == 6 * 8 * 8 * 6
    assert op.flops(hidden, index, weights, gate_up, backward=True) == 3 * op.flops(hidden, index, weights, gate_up)
    fwd = op.bytes_moved(hidden, index, weights, gate_up, down)
    assert fwd == 2 * 4 * 8 * 4 + (3 * 12 * 8 + 3 * 8 * 6) * 4


# ---------------------------------------------------------------------------------------------
# the hot path's guard: every tensor's whole shape is pinned, the class holds the rest


class _Sub(torch.Tensor):
    pass


def _guard_variants(name):
    def f(*shape, grad=False, dtype=torch.float32):
        return torch.randn(shape, dtype=dtype).requires_grad_(grad)

    if name == "moe_router":
        base = (f(4, 8), 2, True)
        return base, [
            ("same again", base),
            ("more tokens", (f(6, 8), 2, True)),
            ("3-d", (f(2, 3, 8), 2, True)),
            ("k = 3", (base[0], 3, True)),
            ("k = 9", (base[0], 9, True)),
            ("raw", (base[0], 2, False)),
            ("E = 16", (f(4, 16), 2, True)),
            ("bf16", (f(4, 8, dtype=torch.bfloat16), 2, True)),
            ("requires grad", (f(4, 8, grad=True), 2, True)),
            ("a subclass", (base[0].as_subclass(_Sub), 2, True)),
        ]
    x, index, w, gu, d = _good()
    base = (x, index, w, gu, d, "silu")

    def with_(**kw):
        names = ("hidden", "index", "weights", "gate_up", "down", "activation")
        return tuple(kw.get(n, a) for n, a in zip(names, base))

    six = torch.tensor([[0, 1], [2, 0], [1, 1], [2, 2], [0, 2], [1, 0]])
    return base, [
        ("same again", base),
        ("more tokens", with_(hidden=f(6, 8), index=six, weights=torch.rand(6, 2))),
        ("int32 index", with_(index=index.int())),
        ("fp64 weights", with_(weights=w.double())),
        ("weights T = 5", with_(weights=torch.rand(5, 2))),
        ("hidden T = 5", with_(hidden=f(5, 8))),
        ("k = 1", with_(index=index[:, :1].contiguous(), weights=torch.rand(4, 1))),
        ("hidden requires grad", with_(hidden=f(4, 8, grad=True))),
        ("down requires grad", with_(down=d.clone().requires_grad_())),
        ("gelu", with_(activation="gelu")),
        ("bad activation", with_(activation="relu")),
        ("E = 4", with_(gate_up=f(4, 12, 8), down=f(4, 8, 6))),
        ("I = 7", with_(gate_up=f(3, 14, 8), down=f(3, 8, 7))),
        ("down I = 7 only", with_(down=f(3, 8, 7))),
        ("H = 9 for hidden only", with_(hidden=f(4, 9))),
        ("bf16", with_(hidden=x.bfloat16(), weights=w.bfloat16(), gate_up=gu.bfloat16(), down=d.bfloat16())),
        ("gate_up bf16 only", with_(gate_up=gu.bfloat16())),
        ("a subclass", with_(down=d.as_subclass(_Sub))),
    ]


@pytest.mark.skipif(_compat.tensor_guards() is None, reason="no TensorGuards here: no guarded decisions")
@pytest.mark.parametrize("name", ["moe_experts", "moe_router"])
def test_the_guard_never_reuses_a_decision_for_another_class(name):
    from polykernel.core import memo_key, registry
    from polykernel.core import selection as dispatch

    the_op = registry.get_op(name)
    base, variants = _guard_variants(name)
    base_key = memo_key.key(the_op.key(*base), None, (), False)
    for label, args in variants:
        polykernel.clear_caches()
        the_op.dispatch(None, *base)
        the_op.dispatch(None, *base)
        assert the_op._fast, "the base call installed a guard"
        try:
            expected = memo_key.key(the_op.key(*args), None, dispatch.SCOPE.get(), False)
        except Exception:
            expected = None
        try:
            the_op.dispatch(None, *args)
        except (OpArgumentError, OpTypeError):
            with pytest.raises((OpArgumentError, OpTypeError)):  # validation rejects it as well
                the_op.validate(*args)
            continue
        assert {k._replace(subclass=None) for k in the_op._memo} == {base_key, expected}, label


@pytest.mark.parametrize("impl", IMPLS)
def test_torch_func_grad_and_vmap(impl):
    # functorch transforms hand the call to the reference's torch ops (the kernels cannot read
    # the transforms' wrapped tensors), with no runtime fault recorded
    _need(impl)
    import warnings

    from torch.func import grad, vmap

    hidden, index, weights, gate_up, down = (a.detach() for a in _case("13x24x40-E5-k2").args)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        g = grad(lambda w: polykernel.moe_experts(hidden, index, w, gate_up, down, impl=impl).pow(2).sum())(weights)
        batch = torch.stack([hidden, 2 * hidden])
        ys = vmap(lambda x: polykernel.moe_experts(x, index, weights, gate_up, down, impl=impl))(batch)
    w2 = weights.clone().requires_grad_()
    (want,) = torch.autograd.grad(op.reference(hidden, index, w2, gate_up, down).pow(2).sum(), (w2,))
    torch.testing.assert_close(g, want)
    torch.testing.assert_close(ys[1], op.reference(2 * hidden, index, weights, gate_up, down))


# ---------------------------------------------------------------------------------------------
# GPU (skipped without CUDA)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_parity_gpu_large(dtype, bad_index_runs):
    # bad_index_runs: the bad-index scripts start with the first GPU test, their start-ups
    # (torch, CUDA, the kernels' first calls) overlapping these checks
    moe.assert_gpu_parity("moe_experts", op, dtype)  # float64 references of a few GB
    assert_parity("moe_router", device="cuda", dtypes=[dtype], large=True)


_BAD_INDEX_SCRIPT = """
import sys, torch, polykernel
x = torch.randn(8, 64, device="cuda", dtype=torch.bfloat16)
index = torch.tensor([[0, 1]] * 7 + [[1, {bad}]], device="cuda")
weights = torch.rand(8, 2, device="cuda", dtype=torch.bfloat16)
gate_up = torch.randn(4, 128, 64, device="cuda", dtype=torch.bfloat16)
down = torch.randn(4, 64, 64, device="cuda", dtype=torch.bfloat16)
print("calling", flush=True)  # set-up done: what follows is the call
try:
    y = polykernel.moe_experts(x, index, weights, gate_up, down, impl=sys.argv[1])
    torch.cuda.synchronize()
except Exception as exc:
    print("raised", type(exc).__name__, str(exc)[:200])
    sys.exit(0)
print("passed silently", y.float().abs().sum().item())
"""


@pytest.fixture(scope="module")
def bad_index_runs(tmp_path_factory):
    impls = [i for i in ("torch", "triton", "liger") if i in runnable_impls("moe_experts", "cuda", torch.bfloat16)]
    with moe.bad_index_runs(_BAD_INDEX_SCRIPT, impls, str(tmp_path_factory.mktemp("bad_index"))) as runs:
        yield runs


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["torch", "triton", "liger"])
@pytest.mark.parametrize("bad", [4, -1])
def test_an_index_outside_the_experts_never_passes_silently_on_the_gpu(impl, bad, bad_index_runs):
    # off the CPU the check is on the device (a device-side assert)
    if impl not in runnable_impls("moe_experts", "cuda", torch.bfloat16):
        pytest.skip(f"{impl} not runnable here")
    bad_index_runs.check(impl, bad)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS)
def test_cuda_graph_replay_matches_eager(impl):
    moe.graph_replay_matches_eager(polykernel.moe_experts, op, impl)
