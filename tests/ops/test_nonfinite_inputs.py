"""Non-finite and extreme inputs: every runnable impl against the op's reference (NaN, inf and
-inf where they belong, nowhere else), on the CPU (Triton through its interpreter) and, under the
gpu mark, on CUDA (compiled Triton: its NaN handling in min/max/clamp is the hardware's)."""

from functools import partial

import pytest
import torch

import polykernel
from polykernel.core import registry
from polykernel.testing import runnable_impls

IMPLS = ["torch", "triton"]


@pytest.fixture(autouse=True, params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    with torch.device(request.param):  # every tensor a test makes lands there
        yield request.param


def _need(op, impl, dtype=torch.float32):
    here = torch.get_default_device()
    if impl not in runnable_impls(op, here, dtype):
        pytest.skip(f"{impl} not runnable on {here.type} here")


def _same(got, want):
    """Equal non-finite pattern, finite values close (want is the float64 reference)."""
    torch.testing.assert_close(got.double(), want.double(), rtol=1e-4, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kw", [{}, {"reduction": "none", "z_loss": 1e-3}, {"label_smoothing": 0.1, "reduction": "sum"}], ids=str)
def test_cross_entropy_ignored_rows_with_non_finite_logits_give_zero_gradients(impl, kw):
    # torch documents that ignored targets do not contribute to the gradient; F.cross_entropy's
    # backward gave NaN on such a row (0·NaN), and so did the reference and the torch impl, while
    # the Triton impl gave 0: one answer now, 0, and a padding row poisons nothing
    _need("cross_entropy", impl)
    x = torch.randn(5, 40)
    x[1], x[2, 3], x[3] = float("nan"), float("inf"), float("-inf")
    t = torch.tensor([1, -100, -100, -100, 4])
    xi, xr = x.clone().requires_grad_(), x.double().requires_grad_()
    loss = polykernel.cross_entropy(xi, t, impl=impl, **kw)
    want = registry.get_op("cross_entropy").reference(xr, t, **kw)
    _same(loss, want)
    assert loss.isfinite().all()
    cot = torch.rand_like(want)
    (g,) = torch.autograd.grad(loss, xi, cot.float())
    (gr,) = torch.autograd.grad(want, xr, cot)
    assert bool((g[1:4] == 0).all()) and bool((gr[1:4] == 0).all()) and g.isfinite().all()
    _same(g, gr)


@pytest.mark.parametrize("impl", IMPLS)
def test_fused_linear_ce_ignored_row_with_nan_hidden_poisons_no_other_row(impl):
    # the ignored row's dlogits are 0, so its grad_hidden is 0; grad_weight = dlogitsᵀ·hidden
    # takes 0·NaN in that NaN's column only, as the reference's matmul does
    _need("fused_linear_cross_entropy", impl)
    h, w = torch.randn(4, 16), torch.randn(50, 16)
    h[1, 2] = float("nan")
    t = torch.tensor([1, -100, 3, 4])
    hi, wi = h.clone().requires_grad_(), w.clone().requires_grad_()
    hr, wr = h.double().requires_grad_(), w.double().requires_grad_()
    loss = polykernel.fused_linear_cross_entropy(hi, wi, t, impl=impl)
    want = registry.get_op("fused_linear_cross_entropy").reference(hr, wr, t)
    _same(loss, want)
    gh, gw = torch.autograd.grad(loss, (hi, wi))
    ghr, gwr = torch.autograd.grad(want, (hr, wr))
    assert bool((gh[1] == 0).all()) and gh.isfinite().all() and bool(gw[:, 2].isnan().all())
    _same(gh, ghr)
    _same(gw, gwr)


def _grads(op, impl, args, kwargs, grad_of=(0,)):
    """(loss, grads) of ``impl`` and of the float64 reference on the same values."""
    mine = [a.clone().requires_grad_(i in grad_of) if torch.is_tensor(a) and a.is_floating_point() else a for i, a in enumerate(args)]
    ref = [a.double().requires_grad_(i in grad_of) if torch.is_tensor(a) and a.is_floating_point() else a for i, a in enumerate(args)]
    out = getattr(polykernel, op)(*mine, impl=impl, **kwargs)
    want = registry.get_op(op).reference(*ref, **kwargs)
    g = torch.autograd.grad(out, [mine[i] for i in grad_of])
    gr = torch.autograd.grad(want, [ref[i] for i in grad_of])
    return out, want, g, gr


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op", ["jsd", "tvd"])
def test_distill_ignored_rows_with_non_finite_values_give_zero_gradients(op, impl):
    # as cross_entropy's: the reference masked the ignored rows after the math, so their
    # gradient was 0·NaN = NaN there, while both impls gave 0
    _need(op, impl)
    a, b = torch.randn(4, 30).log_softmax(-1), torch.randn(4, 30).log_softmax(-1)
    if op == "tvd":
        a, b = a.exp(), b.exp()
    a[1, 2], a[2, 0], b[2, 5] = float("nan"), float("inf"), float("-inf")
    labels = torch.tensor([1, -100, -100, 3])
    out, want, (g,), (gr,) = _grads(op, impl, (a, b, labels), {})
    _same(out, want)
    assert out.isfinite() and bool((g[1:3] == 0).all()) and g.isfinite().all()
    _same(g, gr)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("reduction", ["batchmean", "sum"])
def test_tvd_nan_gradient_follows_torch_sign(impl, reduction):
    # the reference's abs backward is torch.sign, 0 at NaN (the loss is NaN); Triton gave NaN
    _need("tvd", impl)
    p, q = torch.rand(2, 7).softmax(-1), torch.rand(2, 7).softmax(-1)
    p[0, 1] = float("nan")
    out, want, (gp, gq), (gpr, gqr) = _grads("tvd", impl, (p, q), {"reduction": reduction}, grad_of=(0, 1))
    assert out.isnan() and want.isnan()
    _same(gp, gpr)
    _same(gq, gqr)


@pytest.mark.parametrize("impl", IMPLS)
def test_fused_linear_jsd_ignored_row_with_nan_hidden_gives_zero_gradient(impl):
    # the reference's log_softmax backward gave 0·NaN = NaN on the ignored row; the impls gave 0
    _need("fused_linear_jsd", impl)
    hs, ws, ht, wt = torch.randn(4, 16), 0.3 * torch.randn(50, 16), torch.randn(4, 16), 0.3 * torch.randn(50, 16)
    hs[1, 2], ht[2, 0] = float("nan"), float("inf")
    labels = torch.tensor([1, -100, -100, 3])
    out, want, (gh, gw), (ghr, gwr) = _grads("fused_linear_jsd", impl, (hs, ws, ht, wt, labels), {}, grad_of=(0, 1))
    _same(out, want)
    assert out.isfinite() and bool((gh[1:3] == 0).all()) and gh.isfinite().all()
    _same(gh, ghr)
    _same(gw, gwr)  # NaN in column 2 only: 0·NaN in dlogitsᵀ·hidden, as the reference's matmul


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op", ["fused_linear_dpo_loss", "fused_linear_orpo_loss"])
def test_preference_ignored_tokens_with_non_finite_hidden_give_zero_gradient(op, impl):
    # the reference's and the torch impl's dlogits were −0·softmax on an ignored token, NaN
    # when its hidden state holds a NaN or inf; the Triton impl gave 0
    _need(op, impl)
    hid, w = torch.randn(4, 5, 8), 0.3 * torch.randn(40, 8)
    t = torch.randint(0, 40, (4, 5))
    t[:, -2:] = -100
    hid[0, -1, 3], hid[1, -2] = float("nan"), float("inf")
    mine, ref = (hid.clone().requires_grad_(), w.clone().requires_grad_()), (hid.double().requires_grad_(), w.double().requires_grad_())
    out = getattr(polykernel, op)(*mine, t, impl=impl).loss
    want = registry.get_op(op).reference(*ref, t)[0]
    _same(out, want)
    (gh, gw), (ghr, gwr) = torch.autograd.grad(out, mine), torch.autograd.grad(want, ref)
    assert out.isfinite() and bool((gh[0, -1] == 0).all()) and bool((gh[1, -2] == 0).all()) and gh.isfinite().all()
    _same(gh, ghr)
    _same(gw, gwr)  # all NaN: the inf row's 0·inf in dlogitsᵀ·hidden, as the reference's matmul


def _rl_loss(op, impl, hid, w, t, kw):
    """(loss, d hidden, d weight) of ``impl`` (None: the float64 reference) for KTO or GRPO on
    targets ``t`` (-100: ignored; GRPO reads it as its attention mask)."""
    h, w = (hid.double(), w.double()) if impl is None else (hid.clone(), w.clone())
    h.requires_grad_(), w.requires_grad_()
    if op == "fused_linear_kto_loss":
        args = (h, w, t, torch.tensor([True, False, True, False]))
    else:
        args = (h, w, t.clamp(min=0), (t != -100).long(), torch.tensor([1.0, -0.5, 0.0, 2.0]))
    fn = registry.get_op(op).reference if impl is None else partial(getattr(polykernel, op), impl=impl)
    loss = fn(*args, **kw)[0]
    return (loss, *torch.autograd.grad(loss, (h, w)))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "op, kw",
    [
        ("fused_linear_kto_loss", {"kl": 0.1}),
        ("fused_linear_grpo_loss", {"beta": 0.0}),
        (
            "fused_linear_grpo_loss",
            {"importance_sampling_level": "sequence", "loss_type": "bnpo", "epsilon_low": 0.0, "epsilon_high": 0.0, "beta": 0.0},
        ),
    ],
    ids=["kto", "grpo", "grpo-sequence-eps0"],
)
def test_kto_grpo_ignored_tokens_with_non_finite_hidden_give_zero_gradient(op, impl, kw):
    # as DPO's and ORPO's above; GRPO's sequence 1 is all masked (it counts 0) and sequence 2
    # has advantage 0
    _need(op, impl)
    hid, w = torch.randn(4, 5, 8), 0.3 * torch.randn(40, 8)
    t = torch.randint(0, 40, (4, 5))
    t[:, -2:], t[1] = -100, -100
    hid[0, -1, 3], hid[2, -2], hid[1] = float("nan"), float("inf"), float("-inf")
    out, gh, gw = _rl_loss(op, impl, hid, w, t, kw)
    want, ghr, gwr = _rl_loss(op, None, hid, w, t, kw)
    _same(out, want)
    assert out.isfinite() and bool((gh[t == -100] == 0).all()) and bool((ghr[t == -100] == 0).all()) and gh.isfinite().all()
    _same(gh, ghr)
    _same(gw, gwr)


# -- MoE experts: a token's or an expert's NaN reaches only what it is routed to ---------------------
# expert 0 serves token 0 alone; token 2 is routed to experts 2 and 3
_MOE_INDEX = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 1], [1, 2], [2, 3]])


def _moe_args(op, t=6, h=16, inter=16, e=4):
    """(hidden, index, weights, *params) of ``op`` in its layout, every float tensor fp32."""
    w = torch.rand(t, 2) + 0.1
    if op == "moe_experts":
        params = (torch.randn(e, 2 * inter, h) / 4, torch.randn(e, h, inter) / 4)
    else:  # gate_up [E, H, 2I] + bias, down [E, I, H] + bias
        params = (torch.randn(e, h, 2 * inter) / 4, 0.1 * torch.randn(e, 2 * inter), torch.randn(e, inter, h) / 4, 0.1 * torch.randn(e, h))
    return [torch.randn(t, h), _MOE_INDEX.to(torch.get_default_device()), w / w.sum(-1, keepdim=True), *params]


def _moe_grads(op, impl, args, **kw):
    """(out, want, grads, reference grads) of ``impl`` and of the float64 reference, the grads of
    every float argument for one random cotangent."""
    mine = [a.clone().requires_grad_(a.is_floating_point()) for a in args]
    ref = [a.double().requires_grad_() if a.is_floating_point() else a for a in args]
    out = getattr(polykernel, op)(*mine, impl=impl, **kw)
    want = registry.get_op(op).reference(*ref, **kw)
    cot = torch.rand_like(want)
    g = torch.autograd.grad(out, [a for a in mine if a.requires_grad], cot.float())
    gr = torch.autograd.grad(want, [a for a in ref if a.requires_grad], cot)
    return out, want, g, gr


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op", ["moe_experts", "moe_experts_gpt_oss"])
def test_moe_nan_in_one_token_stays_in_that_token(op, impl):
    # Triton's clamped SwiGLU (gpt-oss) took min/max that drop NaN: the NaN token came out finite
    _need(op, impl)
    args = _moe_args(op)
    args[0][2, 3] = float("nan")
    kw = {"limit": 3.0} if op == "moe_experts_gpt_oss" else {}
    out, want, g, gr = _moe_grads(op, impl, args, **kw)
    assert bool(out[2].isnan().all()) and out[[0, 1, 3, 4, 5]].isfinite().all()
    assert g[0][[0, 1, 3, 4, 5]].isfinite().all()  # d hidden of the other tokens
    _same(out, want)
    for a, b in zip(g, gr):
        _same(a, b)


def test_moe_gpt_oss_gradient_at_exactly_the_limit():
    # torch's clamp passes the gradient at the limits themselves (ends included); zero projections
    # and biases of exactly ±limit, below and above, put the pre-activations there
    for impl in IMPLS:
        _need("moe_experts_gpt_oss", impl)
    args = _moe_args("moe_experts_gpt_oss")
    args[3].zero_()
    args[4].copy_(torch.tensor([7.0, -7.0, 8.0, -8.0, 6.5, 0.0, 14.0, 7.0]).repeat(4, 4))
    for impl in IMPLS:
        out, want, g, gr = _moe_grads("moe_experts_gpt_oss", impl, args)
        _same(out, want)
        for a, b in zip(g, gr):
            _same(a, b)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op", ["moe_experts", "moe_experts_gpt_oss"])
@pytest.mark.parametrize("bad", ["gate_up_proj", "down_proj", "top_k_weights"])
def test_moe_nan_in_one_expert_reaches_only_its_tokens(op, impl, bad):
    # the reference ran every expert on every token and scaled by a 0 weight: 0·NaN made every
    # token's output (a NaN expert weight) or every expert's gradient (a NaN routing weight) NaN,
    # where the impls, which compute only the routed pairs, confine it to expert 0's token 0
    _need(op, impl)
    args = _moe_args(op)
    if bad == "top_k_weights":
        args[2][0, 0] = float("nan")  # token 0's weight for expert 0
    else:
        args[{"gate_up_proj": 3, "down_proj": 4 if op == "moe_experts" else 5}[bad]][0, 1, 2] = float("nan")
    out, want, g, gr = _moe_grads(op, impl, args)
    assert out[1:].isfinite().all() and g[0][1:].isfinite().all() and g[1][1:].isfinite().all()  # other tokens, their weights
    assert all(p[1:].isfinite().all() for p in g[2:])  # the other experts' parameters
    _same(out, want)
    for a, b in zip(g, gr):
        _same(a, b)


# -- torch_compile: Inductor's generated code on non-finite inputs --------------------------------
def _nonfinite_rows(*shape):
    """Rows: a NaN, an inf, all -inf, all 0, then finite ones (the last dim is a row)."""
    x = torch.randn(*shape)
    rows = x.view(-1, shape[-1])
    rows[0, 1], rows[1, 2], rows[2], rows[3] = float("nan"), float("inf"), float("-inf"), 0.0
    return x.requires_grad_()


def _compile_cases():
    from polykernel.core.values import Case

    w = lambda n: (1 + 0.1 * torch.randn(n)).requires_grad_()
    r = lambda *s: torch.randn(*s).requires_grad_()
    return {
        "rms_norm": Case("rows", (_nonfinite_rows(6, 24), w(24)), {"offset": 1.0}),
        "fused_add_rms_norm": Case("rows", (_nonfinite_rows(6, 24), r(6, 24), w(24))),
        "layer_norm": Case("rows", (_nonfinite_rows(6, 24), w(24), r(24))),
        "swiglu": Case("rows", (_nonfinite_rows(6, 24), _nonfinite_rows(6, 24))),
        "geglu": Case("rows", (_nonfinite_rows(6, 24), r(6, 24))),
        "silu_and_mul": Case("rows", (_nonfinite_rows(6, 48).detach(),)),
        "rope": Case("rows", (_nonfinite_rows(1, 2, 3, 16), r(1, 1, 3, 16), torch.rand(1, 3, 16), torch.rand(1, 3, 16))),
    }


@pytest.mark.slow
@pytest.mark.parametrize("op", ["rms_norm", "fused_add_rms_norm", "layer_norm", "swiglu", "geglu", "silu_and_mul", "rope"])
def test_torch_compile_non_finite_inputs_through_inductor(op, monkeypatch):
    # Inductor may fuse and reorder the reference's math (x - max, x·σ(x), rsqrt(mean)); NaN, inf
    # and -inf must land where the float64 reference puts them, forward and backward
    from polykernel.backends.torch_compile import _compiled
    from polykernel.testing import assert_parity

    _need(op, "torch_compile")
    monkeypatch.setattr(_compiled, "BACKEND", "inductor")
    monkeypatch.setattr(_compiled, "_ops", {})
    assert_parity(op, ["torch_compile"], device=torch.get_default_device(), dtypes=[torch.float32], cases=[_compile_cases()[op]])
    assert _compiled._ops[registry.get_op(op).id]._seen  # it did compile
