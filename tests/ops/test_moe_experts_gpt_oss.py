"""moe_experts_gpt_oss: parity of every runnable impl with the reference, the reference against a
per-token loop and against transformers' own ``GptOssExperts`` (output and every gradient, with
many values clamped), awkward routings, argument errors, torch.compile. The Triton impl runs
through the CPU interpreter at tiny shapes."""

import functools

import pytest
import torch

import _moe_helpers as moe
import polykernel
from polykernel import _compat
from polykernel.backends.torch import moe_experts_gpt_oss as torch_impl
from polykernel.errors import OpArgumentError, OpTypeError
from polykernel.ops import moe_experts_gpt_oss as op
from polykernel.testing import assert_parity

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
IMPLS = ["torch", "triton"]
GRAD_ARGS = (0, 2, 3, 4, 5, 6)


_need = functools.partial(moe.need, "moe_experts_gpt_oss")
_case = functools.partial(moe.case, op)
_f64 = moe.f64


def per_token(hidden, index, weights, gate_up, gate_up_bias, down, down_bias, alpha=op.ALPHA, limit=op.LIMIT):
    """The docstring's formula, literally: one token and one of its k slots at a time."""
    rows = []
    for t in range(hidden.shape[0]):
        acc = torch.zeros_like(hidden[t])
        for j in range(index.shape[1]):
            e = int(index[t, j])
            gu = hidden[t] @ gate_up[e] + gate_up_bias[e]
            g, u = torch.clamp(gu[0::2], max=limit), torch.clamp(gu[1::2], -limit, limit)
            acc = acc + weights[t, j] * ((u + 1) * g * torch.sigmoid(alpha * g) @ down[e] + down_bias[e])
        rows.append(acc)
    return torch.stack(rows) if rows else hidden.new_zeros(hidden.shape)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", IMPLS)
def test_parity_cpu(impl, dtype):
    _need(impl, dtype)
    assert_parity("moe_experts_gpt_oss", [impl], device="cpu", dtypes=[dtype])


def test_reference_is_the_per_token_formula():
    moe.reference_is_the_per_token_formula(op, per_token, GRAD_ARGS)


def test_clamped_cases_clamp_many_values_and_none_near_the_limit():
    # the clamped cases must exercise both clamps (the gradient mask) and keep a margin from the limit
    for label in ("13x24x40-E5-k2-clamped", "9x17x23-E3-k2-odd-clamped"):
        case = _case(label)
        hidden, index, _, gate_up, gate_up_bias, *_ = _f64(case.args)
        limit = case.kwargs["limit"]
        gu = torch.einsum("ph,phn->pn", hidden[torch.arange(hidden.shape[0]).repeat_interleave(index.shape[1])], gate_up[index.reshape(-1)])
        gu = gu + gate_up_bias[index.reshape(-1)]
        gate, up = gu[:, 0::2], gu[:, 1::2]
        assert (gate > limit).sum() >= 5 and (up.abs() > limit).sum() >= 5, label
        assert torch.cat(((gate - limit).abs().flatten(), (up.abs() - limit).abs().flatten())).min() > 1e-3 * limit


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("label", ["13x24x40-E5-k2-clamped", "12x24x40-E8-k2-empty-experts", "20x24x40-E5-k1-skew90", "1x24x40-E5-k1"])
def test_every_gradient_against_the_per_token_formula(impl, label):
    _need(impl)
    fn = functools.partial(polykernel.moe_experts_gpt_oss, impl=impl)
    moe.every_gradient_within_the_error_model(fn, op, _case(label), per_token, GRAD_ARGS)


@pytest.mark.parametrize("impl", IMPLS)
def test_unused_experts_get_exactly_zero_gradients(impl):
    _need(impl)
    case = _case("12x24x40-E8-k2-empty-experts")
    out = polykernel.moe_experts_gpt_oss(*case.args, impl=impl)
    grads = torch.autograd.grad(out, case.args[3:], torch.randn_like(out))
    unused = [e for e in range(8) if e not in (1, 6)]
    for g in grads:
        assert g[unused].count_nonzero() == 0 and g[[1, 6]].count_nonzero() > 0


@pytest.mark.parametrize("impl", IMPLS)
def test_matches_transformers_gpt_oss_experts_output_and_every_gradient(impl):
    _need(impl)
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    config = transformers.GptOssConfig(hidden_size=32, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)
    theirs = GptOssExperts(config)
    with torch.no_grad():  # large enough that both clamps (limit 7) act on many values
        for p in theirs.parameters():
            p.copy_(torch.randn_like(p) * (1.0 if p.dim() == 3 else 2.0))
    params = [theirs.gate_up_proj, theirs.gate_up_proj_bias, theirs.down_proj, theirs.down_proj_bias]
    x = torch.randn(19, 32, requires_grad=True)
    top, index = torch.topk(torch.randn(19, 4), 2)
    weights = torch.softmax(top, 1).requires_grad_()  # GptOssTopKRouter's scores
    gu = torch.einsum("th,thn->tn", x.repeat_interleave(2, 0), params[0][index.reshape(-1)]) + params[1][index.reshape(-1)]
    assert (gu[:, 0::2] > theirs.limit).float().mean() > 0.1 and (gu[:, 1::2].abs() > theirs.limit).float().mean() > 0.1
    want = theirs(x, index, weights)
    dy = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, [x, weights, *params], dy)
    polykernel.clear_caches()
    got = polykernel.moe_experts_gpt_oss(x, index, weights, *params, alpha=theirs.alpha, limit=theirs.limit, impl=impl)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    for name, a, b in zip(
        ("hidden", "weights", "gate_up", "gate_up_bias", "down", "down_bias"),
        torch.autograd.grad(got, [x, weights, *params], dy),
        want_grads,
    ):
        # fp32 sums whose terms reach ~1e3 (weights: H products of dy and the expert output) cancel
        # to small elements: their rounding is relative to the largest term, not to the element
        # (~2e-7 of max|b| seen; a fixed atol of 1e-4 failed on some seeds, tighter than that here)
        torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-6 * b.abs().max().item(), msg=name)
    assert {d["impl"] for d in polykernel.decisions("moe_experts_gpt_oss")} == {impl}


@pytest.mark.parametrize("impl", IMPLS)
def test_deterministic_mode_gives_the_same_bits_twice(impl):
    _need(impl)
    case = _case("20x24x40-E5-k1-skew90")
    runs = []
    with moe.deterministic():
        for _ in range(2):
            out = polykernel.moe_experts_gpt_oss(*case.args, impl=impl)
            runs.append((out, *torch.autograd.grad(out, [case.args[i] for i in GRAD_ARGS], torch.ones_like(out))))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_float64_matches_the_reference():
    case = _case("13x24x40-E5-k2-clamped")
    args = _f64(case.args)
    torch.testing.assert_close(
        polykernel.moe_experts_gpt_oss(*args, **case.kwargs), op.reference(*args, **case.kwargs), rtol=1e-12, atol=1e-12
    )


def test_torch_grouped_mm_and_the_expert_loop_agree(monkeypatch):
    case = _case("13x24x40-E5-k2")
    args = [a.detach() for a in case.args]
    if torch_impl.grouped_mm_refusal(args[0], args[3], args[5]) is not None:
        pytest.skip("torch._grouped_mm does not run here")
    grouped = torch_impl.moe_experts_gpt_oss(*args, op.ALPHA, op.LIMIT)
    monkeypatch.setattr(torch_impl, "grouped_mm_refusal", lambda *a: "forced")
    looped = torch_impl.moe_experts_gpt_oss(*args, op.ALPHA, op.LIMIT)
    torch.testing.assert_close(grouped, looped, rtol=1e-5, atol=1e-5)


def test_torch_grouped_mm_refusals_give_reasons():
    x, g, d = torch.randn(4, 17), torch.randn(3, 17, 46), torch.randn(3, 23, 17)
    if _compat.grouped_mm is None:
        assert "no torch._grouped_mm" in torch_impl.grouped_mm_refusal(x, g, d)
        return
    assert "16 bytes" in torch_impl.grouped_mm_refusal(x, g, d)
    assert "fp32/bf16/fp16" in torch_impl.grouped_mm_refusal(x.double(), g.double(), d.double())
    x, g, d = torch.randn(4, 16), torch.randn(3, 16, 48), torch.randn(3, 24, 16)
    assert "contiguous" in torch_impl.grouped_mm_refusal(x, g.mT.contiguous().mT, d)


# ---------------------------------------------------------------------------------------------
# bad input


def _good(t=4, h=8, inter=6, e=3, k=2):
    index = torch.tensor([[0, 2], [1, 2], [0, 1], [2, 0]])[:t, :k]
    return [
        torch.randn(t, h),
        index,
        torch.rand(t, k),
        torch.randn(e, h, 2 * inter),
        torch.randn(e, 2 * inter),
        torch.randn(e, inter, h),
        torch.randn(e, h),
    ]


def _with(i, value):
    args = _good()
    args[i] = value
    return args


@pytest.mark.parametrize(
    "args, kw, exc, words",
    [
        *moe.bad_routing_and_hidden(_with),
        (_with(5, torch.randn(4, 6, 8)), {}, OpArgumentError, "'down_proj'"),  # E = 4 vs gate_up's 3
        (_with(5, torch.randn(3, 8, 6)), {}, OpArgumentError, "'down_proj'"),  # transformers' [E, H, I] layout
        (_with(3, torch.randn(3, 12, 8)), {}, OpArgumentError, "'gate_up_proj'"),  # [E, 2I, H]: not transposed
        (_with(3, torch.randn(3, 8, 11)), {}, OpArgumentError, "'gate_up_proj'"),  # 2I odd
        (_with(4, torch.randn(3, 11)), {}, OpArgumentError, "'gate_up_proj_bias'"),
        (_with(4, torch.randn(2, 12)), {}, OpArgumentError, "'gate_up_proj_bias'"),  # E
        (_with(6, torch.randn(3, 7)), {}, OpArgumentError, "'down_proj_bias'"),
        (_with(6, torch.randn(3, 8, dtype=torch.float64)), {}, OpTypeError, "'down_proj_bias'"),
        (_with(4, None), {}, OpTypeError, "'gate_up_proj_bias'"),
        (_good(), {"limit": 0.0}, OpArgumentError, "'limit'"),
        (_good(), {"limit": float("inf")}, OpArgumentError, "'limit'"),
        (_good(), {"alpha": float("nan")}, OpArgumentError, "'alpha'"),
        (_good(), {"alpha": "1.7"}, OpArgumentError, "'alpha'"),
    ],
)
def test_bad_input_names_op_and_argument(args, kw, exc, words):
    with pytest.raises(exc) as info:
        polykernel.moe_experts_gpt_oss(*args, **kw)
    assert "moe.moe_experts_gpt_oss" in str(info.value) and words in str(info.value)


@pytest.mark.parametrize("impl", IMPLS)
def test_an_impl_called_past_the_public_check_names_this_op_for_a_bad_index(impl):
    # a DTensor's local shards and a compiled graph's custom op reach the impls directly: the
    # sort's own check (on the CPU) must name moe_experts_gpt_oss, not moe_experts
    _need(impl)
    module = torch_impl if impl == "torch" else pytest.importorskip("polykernel.backends.triton.moe_experts_gpt_oss")
    args = _with(1, torch.tensor(moe.INDEX_3))
    with pytest.raises(OpArgumentError, match=r"moe\.moe_experts_gpt_oss.*'top_k_index': expert index 3"):
        module.moe_experts_gpt_oss(*args, op.ALPHA, op.LIMIT)


# ---------------------------------------------------------------------------------------------
# torch.compile


def test_compile_fullgraph_forward_and_backward():
    torch._dynamo.reset()
    args = [a.requires_grad_() if a.is_floating_point() else a for a in _good()]
    leaves = [args[i] for i in GRAD_ARGS]

    def layer(*a):
        return polykernel.moe_experts_gpt_oss(*a, limit=1.5)

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    out = compiled(*args)
    got = torch.autograd.grad(out.sum(), leaves)
    want_out = layer(*args)
    want = torch.autograd.grad(want_out.sum(), leaves)
    torch.testing.assert_close(out, want_out)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    assert any(d["op"] == "moe.moe_experts_gpt_oss" for d in polykernel.decisions())
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------
# GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_parity_gpu_large(dtype, bad_index_runs):
    # bad_index_runs: the bad-index scripts start with the first GPU test, their start-ups
    # (torch, CUDA, the kernels' first calls) overlapping these checks
    moe.assert_gpu_parity("moe_experts_gpt_oss", op, dtype)  # float64 references of a few GB


_BAD_INDEX_SCRIPT = """
import sys, torch, polykernel
x = torch.randn(8, 64, device="cuda", dtype=torch.bfloat16)
index = torch.tensor([[0, 1]] * 7 + [[1, {bad}]], device="cuda")
weights = torch.rand(8, 2, device="cuda", dtype=torch.bfloat16)
params = [torch.randn(*s, device="cuda", dtype=torch.bfloat16) for s in ((4, 64, 128), (4, 128), (4, 64, 64), (4, 64))]
print("calling", flush=True)  # set-up done: what follows is the call
try:
    y = polykernel.moe_experts_gpt_oss(x, index, weights, *params, impl=sys.argv[1])
    torch.cuda.synchronize()
except Exception as exc:
    print("raised", type(exc).__name__, str(exc)[:200])
    sys.exit(0)
print("passed silently", y.float().abs().sum().item())
"""


@pytest.fixture(scope="module")
def bad_index_runs(tmp_path_factory):
    with moe.bad_index_runs(_BAD_INDEX_SCRIPT, IMPLS, str(tmp_path_factory.mktemp("bad_index"))) as runs:
        yield runs


@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bad", [4, -1])
def test_an_index_outside_the_experts_never_passes_silently_on_the_gpu(impl, bad, bad_index_runs):
    bad_index_runs.check(impl, bad)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS)
def test_cuda_graph_replay_matches_eager(impl):
    moe.graph_replay_matches_eager(polykernel.moe_experts_gpt_oss, op, impl)
