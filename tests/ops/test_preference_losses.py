"""The fused preference and RL losses (``fused_linear_{dpo,grpo,...}_loss``) against float64
formulas written here from TRL's and the papers' definitions, forward and backward, on every
impl runnable on the CPU (Triton through the interpreter), with chunks forced small."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import polykernel
from polykernel.backends.torch import _linear_logps
from polykernel.core import registry
from polykernel.core.op import Case
from polykernel.errors import ImplNotAvailableError, OpArgumentError, UnknownImplError
from polykernel.ops import _preference as pref
from polykernel.ops import fused_linear_dpo_loss as dpo_op
from polykernel.ops import fused_linear_grpo_loss as grpo_op
from polykernel.testing import check_parity

IMPLS = ["torch", "triton"]


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """About one unit per chunk at these sizes, so the walk takes several chunks."""
    monkeypatch.setattr(_linear_logps, "CHUNK_BYTES", 2 * 7 * 97 * 6)
    monkeypatch.setattr(_linear_logps, "UNIT_BYTES", 0)  # a unit over the chunk budget: the two-pass walk


def token_logps(h, w, b, t, ignore=-100, temperature=1.0):
    z = h.double() @ w.double().T
    if b is not None:
        z = z + b.double()
    lp = (z / temperature).log_softmax(-1)
    valid = t != ignore
    return torch.where(valid, lp.gather(-1, t.clamp(min=0)[..., None]).squeeze(-1), 0.0), valid


def head(r, t, h, v, *, bias=True, dtype=torch.float32):
    hid = torch.randn(r, t, h).to(dtype).requires_grad_()
    w = (torch.randn(v, h) * 2 / h**0.5).to(dtype).requires_grad_()
    b = (torch.randn(v) * 0.1).to(dtype).requires_grad_() if bias else None
    return hid, w, b


def targets(r, t, v, ignored=0.2):
    tg = torch.randint(0, v, (r, t))
    return tg.masked_fill(torch.rand(r, t) < ignored, -100)


def tol(dtype):
    return {torch.float32: (2e-5, 2e-4), torch.bfloat16: (2e-2, 5e-2), torch.float64: (1e-10, 1e-10)}[dtype]


def assert_grads(got, want, params, dtype):
    g1 = torch.autograd.grad(got, [p for p in params if p is not None])
    g2 = torch.autograd.grad(want, [p for p in params if p is not None])
    rtol, atol = tol(dtype)
    for a, b in zip(g1, g2):
        scale = b.abs().max().clamp(min=1e-30)
        torch.testing.assert_close(a.double() / scale, b.double() / scale, rtol=rtol, atol=atol)


# -- DPO ------------------------------------------------------------------------------------------


def dpo_formula(h, w, b, t, *, ref=None, beta=0.1, average=False, nll=False):
    lp, valid = token_logps(h, w, b, t)
    seq = lp.sum(-1) / (valid.sum(-1) if average else 1)
    k = h.shape[0] // 2
    c, r = seq[:k], seq[k:]
    cr, rr = (0.0, 0.0) if ref is None else ref
    loss = -F.logsigmoid(beta * ((c - r) - (cr - rr))).mean()
    nll_loss = -lp[:k].sum() / valid[:k].sum()
    return (loss + nll_loss if nll else loss), c, r, beta * (c - cr), beta * (r - rr), nll_loss


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "opts",
    [{}, {"beta": 0.5, "average_log_prob": True}, {"compute_nll_loss": True}, {"ref": "logps"}, {"ref": "head"}, {"bias": False}],
    ids=["plain", "avg", "nll", "ref-logps", "ref-head", "nobias"],
)
def test_dpo_matches_formula(impl, opts):
    opts = dict(opts)
    hid, w, b = head(6, 7, 16, 97, bias=opts.pop("bias", True))
    t = targets(6, 7, 97)
    ref_mode = opts.pop("ref", None)
    kw = dict(
        beta=opts.get("beta", 0.1),
        average_log_prob=opts.get("average_log_prob", False),
        compute_nll_loss=opts.get("compute_nll_loss", False),
    )
    ref = None
    if ref_mode == "logps":
        ref = (torch.randn(3) * 5, torch.randn(3) * 5)
        kw.update(ref_chosen_logps=ref[0], ref_rejected_logps=ref[1])
    elif ref_mode == "head":
        rh, rw, rb = head(6, 7, 16, 97)
        kw.update(ref_hidden=rh, ref_weight=rw, ref_bias=rb)
        with torch.no_grad():
            lp, valid = token_logps(rh, rw, rb, t)
            seq = lp.sum(-1) / (valid.sum(-1) if kw["average_log_prob"] else 1)
        ref = (seq[:3], seq[3:])
    out = polykernel.fused_linear_dpo_loss(hid, w, t, b, impl=impl, **kw)
    want = dpo_formula(hid, w, b, t, ref=ref, beta=kw["beta"], average=kw["average_log_prob"], nll=kw["compute_nll_loss"])
    assert out.chosen_logps.shape == (3,) and out.chosen_logps.dtype == torch.float32
    for got, exp in zip(out, want):
        torch.testing.assert_close(got.double(), exp.detach().double(), rtol=2e-5, atol=2e-5)
    if ref_mode == "head":  # the reference head takes no gradient
        assert not kw["ref_hidden"].requires_grad or torch.autograd.grad(out.loss, kw["ref_hidden"], allow_unused=True)[0] is None
        out = polykernel.fused_linear_dpo_loss(hid, w, t, b, impl=impl, **kw)
    assert_grads(out.loss, want[0], (hid, w, b), torch.float32)


@pytest.mark.parametrize("impl", IMPLS)
def test_dpo_bf16_and_grad_output_scaling(impl):
    hid, w, b = head(4, 5, 32, 300, dtype=torch.bfloat16)
    t = targets(4, 5, 300)
    (result,) = check_parity("fused_linear_dpo_loss", [impl], dtypes=[torch.bfloat16], cases=[Case("bf16", (hid, w, t, b), {"beta": 0.3})])
    assert result.ok, str(result)  # the error model of fp32 logits of the bf16 values
    out = polykernel.fused_linear_dpo_loss(hid, w, t, b, impl=impl, beta=0.3)
    (g1,) = torch.autograd.grad(out.loss, hid, torch.tensor(3.0))
    out = polykernel.fused_linear_dpo_loss(hid, w, t, b, impl=impl, beta=0.3)
    (g3,) = torch.autograd.grad(3.0 * out.loss, hid)
    torch.testing.assert_close(g1, g3, rtol=0, atol=0)  # the stored gradients scaled by grad_output, as autograd's own


@pytest.mark.parametrize("impl", IMPLS)
def test_dpo_all_ignored_rows(impl):
    hid, w, b = head(4, 5, 8, 50)
    t = targets(4, 5, 50)
    t[0] = -100  # one chosen row without scored tokens: its sum is 0, its mean 0/0
    out = polykernel.fused_linear_dpo_loss(hid, w, t, b, impl=impl)
    want = dpo_formula(hid, w, b, t)
    torch.testing.assert_close(out.loss.double(), want[0].detach())
    out.loss.backward()
    assert torch.isfinite(hid.grad).all() and (hid.grad[0] == 0).all()
    t[:] = -100  # nothing scored: loss log 2 (margin 0), NLL 0/0 = NaN, gradients 0
    out = polykernel.fused_linear_dpo_loss(hid, w, t, b, impl=impl, compute_nll_loss=True)
    assert torch.isnan(out.loss) and torch.isnan(out.nll_loss)
    out = polykernel.fused_linear_dpo_loss(hid, w, t, b, impl=impl)
    torch.testing.assert_close(out.loss.double(), torch.tensor(2.0).log().double())
    avg = polykernel.fused_linear_dpo_loss(hid, w, t, b, impl=impl, average_log_prob=True)
    assert torch.isnan(avg.loss) == torch.isnan(dpo_formula(hid, w, b, t, average=True)[0])


@settings(max_examples=12, deadline=None)
@given(b=st.integers(1, 3), t=st.integers(1, 9), h=st.integers(1, 12), v=st.integers(1, 70), impl=st.sampled_from(IMPLS))
def test_dpo_hypothesis_shapes(b, t, h, v, impl):
    # the op's reference is the formula (float64, to its last digits); each impl is within the
    # op's error model of the reference (the parity harness)
    hid, w, bias = head(2 * b, t, h, v)
    tg = targets(2 * b, t, v, ignored=0.3)
    exact = [x.detach().double().requires_grad_() for x in (hid, w, bias)]
    got, want = dpo_op.reference(exact[0], exact[1], tg, exact[2], beta=0.2), dpo_formula(*exact[:2], exact[2], tg, beta=0.2)
    for a, c in zip(got, want):
        torch.testing.assert_close(a, c.detach(), rtol=1e-12, atol=1e-12, equal_nan=True)
    assert_grads(got.loss, want[0], exact, torch.float64)
    (result,) = check_parity(
        "fused_linear_dpo_loss", [impl], dtypes=[torch.float32], cases=[Case("drawn", (hid, w, tg, bias), {"beta": 0.2})]
    )
    assert result.ok, str(result)


def test_dpo_float64_is_exact():
    hid, w, b = head(4, 5, 8, 40, dtype=torch.float64)
    t = targets(4, 5, 40)
    out = polykernel.fused_linear_dpo_loss(hid, w, t, b, impl="torch", compute_nll_loss=True)
    want = dpo_formula(hid, w, b, t, nll=True)
    assert out.loss.dtype == torch.float64
    torch.testing.assert_close(out.loss, want[0].detach(), rtol=1e-12, atol=1e-12)
    assert_grads(out.loss, want[0], (hid, w, b), torch.float64)


def test_dpo_nn_module_and_no_grad():
    hid, w, b = head(4, 5, 8, 40)
    t = targets(4, 5, 40)
    m = polykernel.nn.FusedLinearDPOLoss(beta=0.2, compute_nll_loss=True, impl="torch")
    out = m(hid, w, t, b)
    torch.testing.assert_close(out.loss, polykernel.fused_linear_dpo_loss(hid, w, t, b, beta=0.2, compute_nll_loss=True).loss)
    with torch.no_grad():
        assert m(hid, w, t, b).loss.grad_fn is None
    assert "beta=0.2" in repr(m)


def test_backward_twice_is_a_clear_error():
    hid, w, b = head(2, 3, 8, 20)
    out = polykernel.fused_linear_dpo_loss(hid, w, targets(2, 3, 20), b)
    out.loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        out.loss.backward()


# -- GRPO -----------------------------------------------------------------------------------------


def grpo_formula(h, w, b, ids, mask, adv, *, ref=None, old=None, beta=0.04, eps_low=0.2, eps_high=0.2, loss_type="grpo",
                 level="token", temperature=1.0, max_len=None, bias_correction=False):  # fmt: skip
    """TRL 1.16's GRPOTrainer._compute_loss, transcribed (float masks, products)."""
    lp, _ = token_logps(h, w, b, ids, ignore=-(10**9), temperature=temperature)
    m = mask.double()
    old = lp.detach() if old is None else old.double()
    log_ratio = lp - old
    if level == "token":
        liw = log_ratio
    else:
        liw = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    c1 = torch.exp(liw)
    c2 = torch.clamp(c1, 1 - eps_low, 1 + eps_high)
    a = adv.double().unsqueeze(1)
    ptl = -torch.min(c1 * a, c2 * a)
    if beta != 0.0:
        kl = torch.exp(ref.double() - lp) - (ref.double() - lp) - 1
        ptl = ptl + beta * (kl * c1 if bias_correction else kl)  # use_bias_correction_kl: the ratio, differentiable
    if loss_type == "grpo":
        return ((ptl * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    if loss_type in ("bnpo", "dapo"):
        return (ptl * m).sum() / m.sum().clamp(min=1.0)
    return (ptl * m).sum() / (ptl.size(0) * (max_len or ids.shape[1]))


GRPO_OPTS = [
    {"beta": 0.0},
    {"loss_type": "bnpo", "old": True},
    {"loss_type": "dr_grpo", "old": True, "max_completion_length": 9, "temperature": 0.7},
    {"loss_type": "dapo", "old": True, "epsilon_high": 0.28, "beta": 0.0},
    {"importance_sampling_level": "sequence", "old": True},
    {"importance_sampling_level": "sequence", "loss_type": "bnpo", "beta": 0.0},
    {"beta": 0.1, "epsilon_low": 0.0, "old": True, "bias": False},
    {"use_bias_correction_kl": True, "old": True},
    {"use_bias_correction_kl": True, "importance_sampling_level": "sequence", "loss_type": "dapo", "old": True},
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("opts", GRPO_OPTS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()) or "plain")
def test_grpo_matches_trl_formula(impl, opts):
    opts = dict(opts)
    hid, w, b = head(3, 7, 16, 97, bias=opts.pop("bias", True))
    ids = torch.randint(0, 97, (3, 7))
    mask = (torch.rand(3, 7) > 0.3).long()
    mask[0, 0] = 1
    adv = torch.randn(3)
    with torch.no_grad():  # old and ref near the policy's, so the ratios straddle the clip range
        lp, _ = token_logps(hid, w, b, ids, ignore=-(10**9), temperature=opts.get("temperature", 1.0))
    old = (lp + 0.3 * torch.randn(3, 7)).float() if opts.pop("old", False) else None
    beta = opts.get("beta", 0.04)
    ref = (lp + 0.3 * torch.randn(3, 7)).float() if beta != 0 else None
    out = polykernel.fused_linear_grpo_loss(hid, w, ids, mask, adv, b, ref_per_token_logps=ref, old_per_token_logps=old, impl=impl, **opts)
    want = grpo_formula(hid, w, b, ids, mask, adv, ref=ref, old=old, beta=beta, eps_low=opts.get("epsilon_low", 0.2),
                        eps_high=opts.get("epsilon_high", 0.2), loss_type=opts.get("loss_type", "grpo"),
                        level=opts.get("importance_sampling_level", "token"), temperature=opts.get("temperature", 1.0),
                        max_len=opts.get("max_completion_length"), bias_correction=opts.get("use_bias_correction_kl", False))  # fmt: skip
    torch.testing.assert_close(out.loss.double(), want.detach(), rtol=2e-5, atol=2e-6)
    assert (out.metrics.kl is None) == (beta == 0)
    assert 0 <= out.metrics.clip_ratio_region <= 1
    assert_grads(out.loss, want, (hid, w, b), torch.float32)


def test_grpo_metrics_match_trl():
    hid, w, b = head(3, 6, 8, 40)
    ids, mask, adv = torch.randint(0, 40, (3, 6)), (torch.rand(3, 6) > 0.2).long(), torch.randn(3)
    with torch.no_grad():
        lp, _ = token_logps(hid, w, b, ids, ignore=-(10**9))
    old, ref = (lp + torch.randn(3, 6)).float(), (lp + torch.randn(3, 6)).float()
    out = polykernel.fused_linear_grpo_loss(hid, w, ids, mask, adv, b, ref_per_token_logps=ref, old_per_token_logps=old, beta=0.1)
    m = mask.double()
    c1 = torch.exp(lp - old.double())
    low = ((c1 < 0.8) & (adv[:, None] < 0)).double()
    high = ((c1 > 1.2) & (adv[:, None] > 0)).double()
    kl = torch.exp(ref.double() - lp) - (ref.double() - lp) - 1
    for got, x in zip(out.metrics, (kl, low, high, ((low + high) > 0).double())):
        torch.testing.assert_close(got.double(), (x * m).sum() / m.sum(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_grpo_all_masked_is_zero(impl, loss_type):
    hid, w, b = head(2, 4, 8, 30)
    ids, adv = torch.randint(0, 30, (2, 4)), torch.randn(2)
    old = torch.full((2, 4), -1e4)  # masked tokens' ratios overflow: they must take no part
    out = polykernel.fused_linear_grpo_loss(
        hid, w, ids, torch.zeros(2, 4), adv, b, old_per_token_logps=old, beta=0.0, loss_type=loss_type, impl=impl
    )
    assert out.loss.item() == 0.0 and torch.isnan(out.metrics.clip_ratio_low)
    out.loss.backward()
    assert (hid.grad == 0).all() and (w.grad == 0).all()


@settings(max_examples=12, deadline=None)
@given(b=st.integers(1, 4), t=st.integers(1, 9), v=st.integers(1, 70), impl=st.sampled_from(IMPLS),
       level=st.sampled_from(["token", "sequence"]), loss_type=st.sampled_from(["grpo", "bnpo", "dr_grpo", "dapo"]))  # fmt: skip
def test_grpo_hypothesis_shapes(b, t, v, impl, level, loss_type):
    hid, w, bias = head(b, t, 8, v)
    ids, mask, adv = torch.randint(0, v, (b, t)), (torch.rand(b, t) > 0.3).long(), torch.randn(b)
    old = -torch.rand(b, t) * 3
    kw = dict(old_per_token_logps=old, beta=0.0, importance_sampling_level=level, loss_type=loss_type)
    exact = [x.detach().double().requires_grad_() for x in (hid, w, bias)]
    got = grpo_op.reference(exact[0], exact[1], ids, mask, adv, exact[2], **kw)
    want = grpo_formula(*exact[:2], exact[2], ids, mask, adv, old=old, beta=0.0, level=level, loss_type=loss_type)
    torch.testing.assert_close(got.loss, want.detach(), rtol=1e-12, atol=1e-12)  # the reference is the formula
    assert_grads(got.loss, want, exact, torch.float64)
    (result,) = check_parity(
        "fused_linear_grpo_loss", [impl], dtypes=[torch.float32], cases=[Case("drawn", (hid, w, ids, mask, adv, bias), kw)]
    )
    assert result.ok, str(result)


def test_grpo_nn_module():
    hid, w, b = head(2, 4, 8, 30)
    ids, mask, adv = torch.randint(0, 30, (2, 4)), torch.ones(2, 4), torch.randn(2)
    m = polykernel.nn.FusedLinearGRPOLoss(beta=0.0, loss_type="bnpo")
    torch.testing.assert_close(
        m(hid, w, ids, mask, adv, b).loss, polykernel.fused_linear_grpo_loss(hid, w, ids, mask, adv, b, beta=0.0, loss_type="bnpo").loss
    )
    with pytest.raises(TypeError, match="unknown option"):
        polykernel.nn.FusedLinearGRPOLoss(gamma=1.0)


# -- bad input ------------------------------------------------------------------------------------


def _dpo_args():
    hid, w, b = head(4, 3, 8, 20)
    return hid, w, targets(4, 3, 20), b


@pytest.mark.parametrize(
    ("mutate", "arg"),
    [
        (lambda a, k: (a.__setitem__(0, torch.randn(3, 3, 8)), a.__setitem__(2, targets(3, 3, 20))), "hidden"),  # odd batch
        (lambda a, k: a.__setitem__(0, torch.randn(4, 8)), "hidden"),  # rank 2
        (lambda a, k: a.__setitem__(2, torch.zeros(4, 2, dtype=torch.long)), "target"),
        (lambda a, k: a.__setitem__(2, torch.zeros(4, 3)), "target"),  # float targets
        (lambda a, k: a.__setitem__(2, torch.full((4, 3), 20)), "target"),  # out of range
        (lambda a, k: a.__setitem__(1, torch.randn(20, 9)), "weight"),
        (lambda a, k: a.__setitem__(3, torch.randn(19)), "bias"),
        (lambda a, k: k.update(beta=-0.1), "beta"),
        (lambda a, k: k.update(ref_chosen_logps=torch.zeros(2)), "ref_rejected_logps"),
        (lambda a, k: k.update(ref_chosen_logps=torch.zeros(3), ref_rejected_logps=torch.zeros(3)), "ref_chosen_logps"),
        (lambda a, k: k.update(ref_hidden=torch.randn(4, 3, 8)), "ref_weight"),
        (lambda a, k: k.update(ref_hidden=torch.randn(4, 3, 8), ref_weight=torch.randn(21, 8)), "ref_weight"),
    ],
)
def test_dpo_bad_input_names_the_argument(mutate, arg):
    args, kw = list(_dpo_args()), {}
    mutate(args, kw)
    with pytest.raises(OpArgumentError) as info:
        polykernel.fused_linear_dpo_loss(*args, **kw)
    assert info.value.op == "loss.fused_linear_dpo_loss" and info.value.arg == arg


def test_unknown_impl_is_the_dispatchers_error():
    with pytest.raises(UnknownImplError) as info:
        polykernel.fused_linear_dpo_loss(*_dpo_args(), impl="cuda")
    assert info.value.op == "loss.fused_linear_dpo_loss" and "torch" in str(info.value)


def _grpo_args():
    hid, w, b = head(2, 3, 8, 20)
    return [hid, w, torch.randint(0, 20, (2, 3)), torch.ones(2, 3), torch.randn(2), b]


@pytest.mark.parametrize(
    ("mutate", "arg"),
    [
        (lambda a, k: a.__setitem__(4, torch.randn(2, 3)), "advantages"),  # one per token
        (lambda a, k: a.__setitem__(4, torch.randn(3)), "advantages"),
        (lambda a, k: a.__setitem__(3, torch.ones(2, 4)), "attention_mask"),
        (lambda a, k: a.__setitem__(2, torch.zeros(2, 4, dtype=torch.long)), "selected_token_ids"),
        (lambda a, k: a.__setitem__(0, torch.randn(6, 8)), "hidden"),
        (lambda a, k: k.update(beta=-1.0), "beta"),
        (lambda a, k: k.update(beta=0.1), "ref_per_token_logps"),  # the KL term needs the reference's log-probs
        (lambda a, k: k.update(beta=0.0, epsilon_low=1.0), "epsilon_low"),
        (lambda a, k: k.update(beta=0.0, epsilon_low=-0.1), "epsilon_low"),
        (lambda a, k: k.update(beta=0.0, loss_type="ppo"), "loss_type"),
        (lambda a, k: k.update(beta=0.0, importance_sampling_level="seq"), "importance_sampling_level"),
        (lambda a, k: k.update(beta=0.0, old_per_token_logps=torch.zeros(2, 4)), "old_per_token_logps"),
        (lambda a, k: k.update(beta=0.0, temperature=0.0), "temperature"),
        (lambda a, k: k.update(beta=0.0, loss_type="dr_grpo", max_completion_length=0), "max_completion_length"),
    ],
)
def test_grpo_bad_input_names_the_argument(mutate, arg):
    args, kw = _grpo_args(), {}
    mutate(args, kw)
    with pytest.raises(OpArgumentError) as info:
        polykernel.fused_linear_grpo_loss(*args, **kw)
    assert info.value.op == "loss.fused_linear_grpo_loss" and info.value.arg == arg


def test_chunk_size_comes_from_the_problem():
    assert _linear_logps.units_per_chunk(4, 2, 1024, 128256, 2, 1 << 30) == 1  # one pair of 1024-token rows
    assert _linear_logps.units_per_chunk(64, 1, 16, 1000, 2, 1 << 30) == 64  # all of a small batch
    assert _linear_logps.units_per_chunk(8, 1, 1024, 32000, 4, 1 << 30) == 4
    assert _linear_logps.units_per_chunk(8192, 1, 1, 128256, 2, 1 << 30) == 1280  # GRPO tokens: 1395 -> a multiple of 128


# -- ORPO, CPO, SimPO -----------------------------------------------------------------------------


def pair_seq(h, w, b, t, average):
    lp, valid = token_logps(h, w, b, t)
    seq = lp.sum(-1) / (valid.sum(-1) if average else 1)
    k = h.shape[0] // 2
    return seq[:k], seq[k:], -lp[:k].sum() / valid[:k].sum()


def orpo_formula(h, w, b, t, beta=0.1, nll=True):
    c, r, nll_loss = pair_seq(h, w, b, t, True)
    lo = (c - r) - (torch.log1p(-torch.exp(c)) - torch.log1p(-torch.exp(r)))
    loss = -beta * F.logsigmoid(lo).mean() + (nll_loss if nll else 0.0)
    return loss, c, r, beta * c, beta * r, nll_loss, F.logsigmoid(lo).mean(), lo.mean()


def cpo_formula(h, w, b, t, beta=0.1, alpha=1.0, eps=0.0, average=False):
    c, r, nll_loss = pair_seq(h, w, b, t, average)
    z = beta * (c - r)
    loss = (-(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)).mean() + alpha * nll_loss
    return loss, c, r, beta * c, beta * r, nll_loss


def simpo_formula(h, w, b, t, beta=2.0, gamma=0.5, eps=0.0):
    c, r, _ = pair_seq(h, w, b, t, True)
    z = beta * (c - r) - gamma
    return (-(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)).mean(), c, r, beta * c, beta * r


PAIRWISE = [
    ("fused_linear_orpo_loss", orpo_formula, {}, {}),
    ("fused_linear_orpo_loss", orpo_formula, {"beta": 0.5, "compute_nll_loss": False}, {"beta": 0.5, "nll": False}),
    ("fused_linear_cpo_loss", cpo_formula, {}, {}),
    ("fused_linear_cpo_loss", cpo_formula, {"beta": 0.3, "alpha": 0.0, "label_smoothing": 0.1}, {"beta": 0.3, "alpha": 0.0, "eps": 0.1}),
    ("fused_linear_cpo_loss", cpo_formula, {"alpha": 0.5, "average_log_prob": True}, {"alpha": 0.5, "average": True}),
    ("fused_linear_simpo_loss", simpo_formula, {}, {}),
    (
        "fused_linear_simpo_loss",
        simpo_formula,
        {"beta": 1.0, "gamma": 1.5, "label_smoothing": 0.2},
        {"beta": 1.0, "gamma": 1.5, "eps": 0.2},
    ),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("name", "formula", "kw", "fkw"), PAIRWISE, ids=lambda x: x if isinstance(x, str) else "")
def test_pairwise_losses_match_formula(impl, name, formula, kw, fkw):
    hid, w, b = head(6, 7, 16, 97)
    t = targets(6, 7, 97)
    out = getattr(polykernel, name)(hid, w, t, b, impl=impl, **kw)
    want = formula(hid, w, b, t, **fkw)
    assert len(out) == len(want) and out._fields[:3] == ("loss", "chosen_logps", "rejected_logps")
    for got, exp in zip(out, want):
        torch.testing.assert_close(got.double(), exp.detach().double(), rtol=2e-5, atol=2e-5)
    assert_grads(out.loss, want[0], (hid, w, b), torch.float32)


@pytest.mark.parametrize("name", ["fused_linear_orpo_loss", "fused_linear_cpo_loss", "fused_linear_simpo_loss"])
def test_pairwise_bad_input(name):
    hid, w, b = head(3, 3, 8, 20)
    with pytest.raises(OpArgumentError) as info:
        getattr(polykernel, name)(hid, w, targets(3, 3, 20), b)
    assert info.value.arg == "hidden" and "2B" in str(info.value)
    hid, w, b = head(4, 3, 8, 20)
    with pytest.raises(OpArgumentError) as info:
        getattr(polykernel, name)(hid, w, targets(4, 3, 20), b, beta=-1.0)
    assert info.value.arg == "beta"
    if name != "fused_linear_orpo_loss":
        with pytest.raises(OpArgumentError) as info:
            getattr(polykernel, name)(hid, w, targets(4, 3, 20), b, label_smoothing=0.7)
        assert info.value.arg == "label_smoothing"


@pytest.mark.parametrize("impl", IMPLS)
def test_simpo_all_ignored_is_nan_like_its_formula(impl):
    hid, w, b = head(4, 3, 8, 20)
    t = torch.full((4, 3), -100)
    out = polykernel.fused_linear_simpo_loss(hid, w, t, b, impl=impl)
    assert torch.isnan(out.loss) and torch.isnan(simpo_formula(hid, w, b, t)[0])
    out = polykernel.fused_linear_cpo_loss(hid, w, t, b, impl=impl, alpha=0.0)  # sums: 0, so log 2
    torch.testing.assert_close(out.loss.double(), torch.tensor(2.0, dtype=torch.float64).log())


# -- KTO ------------------------------------------------------------------------------------------


def kto_formula(h, w, b, t, labels, ref=None, kl=0.0, beta=0.1, average=False):
    lp, valid = token_logps(h, w, b, t)
    seq = lp.sum(-1) / (valid.sum(-1) if average else 1)
    logr = seq - (0.0 if ref is None else ref)
    loss = torch.where(labels, 1 - torch.sigmoid(beta * (logr - kl)), 1 - torch.sigmoid(beta * (kl - logr))).mean()
    return loss, seq[labels], seq[~labels], beta * logr[labels], beta * logr[~labels]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("ref_mode", [None, "logps", "head"])
@pytest.mark.parametrize("average", [False, True])
def test_kto_matches_formula(impl, ref_mode, average):
    hid, w, b = head(5, 7, 16, 97)
    t = targets(5, 7, 97)
    labels = torch.tensor([True, False, True, True, False])
    kw, ref = {"kl": torch.tensor(0.3), "beta": 0.2, "average_log_prob": average}, None
    if ref_mode == "logps":
        ref = torch.randn(5) * 3
        kw["ref_logps"] = ref
    elif ref_mode == "head":
        rh, rw, rb = head(5, 7, 16, 97)
        kw.update(ref_hidden=rh.detach(), ref_weight=rw.detach(), ref_bias=rb.detach())
        lp, valid = token_logps(rh, rw, rb, t)
        ref = (lp.sum(-1) / (valid.sum(-1) if average else 1)).detach()
    out = polykernel.fused_linear_kto_loss(hid, w, t, labels, b, impl=impl, **kw)
    want = kto_formula(hid, w, b, t, labels, ref=ref, kl=0.3, beta=0.2, average=average)
    for got, exp in zip(out, want):
        torch.testing.assert_close(got.double(), exp.detach().double(), rtol=2e-5, atol=2e-5)
    assert_grads(out.loss, want[0], (hid, w, b), torch.float32)


def test_kto_bad_input():
    hid, w, b = head(3, 3, 8, 20)
    t = targets(3, 3, 20)
    for kw, arg in [
        ({"preference_labels": torch.ones(2, dtype=torch.bool)}, "preference_labels"),
        ({"preference_labels": torch.ones(3)}, "preference_labels"),
        ({"kl": torch.zeros(2)}, "kl"),
        ({"beta": -0.5}, "beta"),
        ({"ref_logps": torch.zeros(3, 3)}, "ref_logps"),
    ]:
        args = {"preference_labels": torch.ones(3, dtype=torch.bool), **kw}
        labels = args.pop("preference_labels")
        with pytest.raises(OpArgumentError) as info:
            polykernel.fused_linear_kto_loss(hid, w, t, labels, b, **args)
        assert info.value.op == "loss.fused_linear_kto_loss" and info.value.arg == arg


@pytest.mark.parametrize(
    ("module", "fn", "args"),
    [
        ("FusedLinearORPOLoss", "fused_linear_orpo_loss", {"beta": 0.3}),
        ("FusedLinearCPOLoss", "fused_linear_cpo_loss", {"alpha": 0.5}),
        ("FusedLinearSimPOLoss", "fused_linear_simpo_loss", {"gamma": 1.0}),
    ],
)
def test_pairwise_nn_modules(module, fn, args):
    hid, w, b = head(4, 3, 8, 20)
    t = targets(4, 3, 20)
    m = getattr(polykernel.nn, module)(**args)
    torch.testing.assert_close(m(hid, w, t, b).loss, getattr(polykernel, fn)(hid, w, t, b, **args).loss)


def test_kto_nn_module():
    hid, w, b = head(3, 3, 8, 20)
    t, labels = targets(3, 3, 20), torch.tensor([True, False, False])
    m = polykernel.nn.FusedLinearKTOLoss(beta=0.3)
    torch.testing.assert_close(
        m(hid, w, t, labels, b, kl=0.1).loss, polykernel.fused_linear_kto_loss(hid, w, t, labels, b, kl=0.1, beta=0.3).loss
    )


# -- the driver: memory, layouts, autograd ---------------------------------------------------------


def test_no_chunk_holds_more_than_its_budget_of_logits(monkeypatch):
    """Never the [N, V] logits: every logits chunk the driver makes stays within the budget
    (whole pairs when one fits, else token chunks in two passes), and the result does not
    depend on the chunking."""
    from polykernel.backends.torch import fused_linear_jsd

    seen = []
    real = fused_linear_jsd.projector

    def spy(weight):
        proj = real(weight)
        return lambda h: seen.append(h.shape[0]) or proj(h)

    monkeypatch.setattr(_linear_logps, "projector", spy)
    hid, w, b = head(8, 5, 8, 300)
    t = targets(8, 5, 300)
    results = []
    for budget, chunks in [
        (2 * 5 * 300 * 8, [10] * 4),  # one pair (2 rows x 5 tokens, fp32 logits + dlogits) per chunk
        (5 * 300 * 8, [5] * 8 * 2),  # one row's worth: token chunks of 5, both passes
        (1 << 30, [40]),  # everything at once
        ("unit", [10] * 4),  # a budget below one pair, but the pair within UNIT_BYTES: one pass, a pair per chunk
    ]:
        seen.clear()
        if budget == "unit":
            budget = 1
            monkeypatch.setattr(_linear_logps, "UNIT_BYTES", 1 << 20)
        monkeypatch.setattr(_linear_logps, "CHUNK_BYTES", budget)
        out = polykernel.fused_linear_dpo_loss(hid, w, t, b, impl="torch")
        assert seen == chunks
        results.append((out.loss, *torch.autograd.grad(out.loss, (hid, w, b))))
    for other in results[1:]:
        for a, c in zip(results[0], other):
            torch.testing.assert_close(a, c)


LOSS_CALLS = {
    "dpo": lambda h, w, b, t, impl: polykernel.fused_linear_dpo_loss(h, w, t, b, compute_nll_loss=True, impl=impl),
    "orpo": lambda h, w, b, t, impl: polykernel.fused_linear_orpo_loss(h, w, t, b, impl=impl),
    "cpo": lambda h, w, b, t, impl: polykernel.fused_linear_cpo_loss(h, w, t, b, impl=impl),
    "simpo": lambda h, w, b, t, impl: polykernel.fused_linear_simpo_loss(h, w, t, b, impl=impl),
    "kto": lambda h, w, b, t, impl: polykernel.fused_linear_kto_loss(h, w, t, torch.tensor([True, False, True, False]), b, kl=0.2, impl=impl),
    "grpo-token": lambda h, w, b, t, impl: polykernel.fused_linear_grpo_loss(
        h, w, t.clamp(min=0), (t >= 0).long(), torch.tensor([1.0, -0.5, 0.3, 2.0]), b, ref_per_token_logps=-torch.ones(t.shape),
        old_per_token_logps=-torch.ones(t.shape), impl=impl,
    ),
    "grpo-seq": lambda h, w, b, t, impl: polykernel.fused_linear_grpo_loss(
        h, w, t.clamp(min=0), (t >= 0).long(), torch.tensor([1.0, -0.5, 0.3, 2.0]), b, beta=0.0,
        old_per_token_logps=-torch.ones(t.shape), importance_sampling_level="sequence", impl=impl,
    ),
}  # fmt: skip


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("loss", list(LOSS_CALLS))
def test_one_pass_and_two_pass_walks_agree(monkeypatch, impl, loss):
    """Whole units per chunk and token chunks (two passes) give the same loss and gradients."""
    hid, w, b = head(4, 6, 8, 50)
    t = targets(4, 6, 50)
    got = []
    for budget in (2 * 6 * 50 * 8, 5 * 50 * 8):  # a pair (two sequences) per chunk; 5 tokens per chunk
        monkeypatch.setattr(_linear_logps, "CHUNK_BYTES", budget)
        out = LOSS_CALLS[loss](hid, w, b, t, impl)
        got.append((out.loss, *torch.autograd.grad(out.loss, (hid, w, b))))
    for a, c in zip(*got):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_strided_inputs_and_partial_requires_grad(impl):
    hid = torch.randn(4, 5, 16)[:, :, ::2].requires_grad_()  # non-contiguous hidden
    w = torch.randn(20, 8)
    t = targets(4, 5, 20).t().contiguous().t()  # [4, 5] view of a transposed buffer
    wt = torch.randn(8, 20).t().requires_grad_(False)
    out = polykernel.fused_linear_dpo_loss(hid, wt, t, impl=impl)
    want = dpo_formula(hid, wt, None, t)
    torch.testing.assert_close(out.loss.double(), want[0].detach(), rtol=2e-5, atol=2e-5)
    (g,) = torch.autograd.grad(out.loss, hid)
    (gw,) = torch.autograd.grad(want[0], hid)
    torch.testing.assert_close(g.double(), gw.double(), rtol=1e-4, atol=1e-6)
    t_strided = targets(4, 10, 20)[:, ::2]  # flattens to a stride-2 view
    labels = torch.tensor([True, False, True, False])
    for ids in (t_strided, t_strided.to(torch.int32)):  # KTO: one slice of rows per chunk, so a view of target
        out = polykernel.fused_linear_kto_loss(hid, wt, ids, labels, impl=impl)
        torch.testing.assert_close(out.loss.double(), kto_formula(hid, wt, None, t_strided, labels)[0].detach(), rtol=2e-5, atol=2e-5)
    w.requires_grad_()  # weight only
    out = polykernel.fused_linear_dpo_loss(hid.detach(), w, t, impl=impl)
    out.loss.backward()
    assert w.grad is not None and w.grad.shape == w.shape


def test_double_backward_is_refused():
    hid, w, b = head(2, 3, 8, 20)
    out = polykernel.fused_linear_dpo_loss(hid, w, targets(2, 3, 20), b)
    with pytest.raises(RuntimeError, match="create_graph"):
        torch.autograd.grad(out.loss, hid, create_graph=True)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("t_len", [0, 1])
def test_empty_and_single_token_sequences(impl, t_len):
    hid, w, b = head(4, t_len, 8, 20)
    t = targets(4, t_len, 20, ignored=0.0)
    out = polykernel.fused_linear_dpo_loss(hid, w, t, b, impl=impl)
    want = dpo_formula(hid, w, b, t)
    torch.testing.assert_close(out.loss.double(), want[0].detach(), rtol=2e-5, atol=2e-5)
    out.loss.backward()
    assert hid.grad.shape == hid.shape and torch.isfinite(w.grad).all()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("v", [1, 2, 1025])
def test_awkward_vocabularies(impl, v):
    hid, w, b = head(3, 4, 8, v)
    ids, mask, adv = torch.randint(0, v, (3, 4)), torch.ones(3, 4), torch.randn(3)
    out = polykernel.fused_linear_grpo_loss(hid, w, ids, mask, adv, b, beta=0.0, impl=impl)
    want = grpo_formula(hid, w, b, ids, mask, adv, beta=0.0)
    torch.testing.assert_close(out.loss.double(), want.detach(), rtol=2e-5, atol=2e-6)
    assert_grads(out.loss, want, (hid, w, b), torch.float32)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", ["fused_linear_orpo_loss", "fused_linear_cpo_loss", "fused_linear_simpo_loss"])
def test_pairwise_bf16(impl, name):
    hid, w, b = head(4, 5, 32, 300, dtype=torch.bfloat16)
    t = targets(4, 5, 300)
    formula = {"fused_linear_orpo_loss": orpo_formula, "fused_linear_cpo_loss": cpo_formula, "fused_linear_simpo_loss": simpo_formula}[name]
    out = getattr(polykernel, name)(hid, w, t, b, impl=impl)
    want = formula(hid, w, b, t)
    torch.testing.assert_close(out.loss.double(), want[0].detach(), rtol=1e-4, atol=1e-4)
    assert_grads(out.loss, want[0], (hid, w, b), torch.bfloat16)


def test_grpo_masked_padding_ids_are_not_checked():
    hid, w, b = head(2, 4, 8, 30)
    ids = torch.randint(0, 30, (2, 4))
    mask = torch.ones(2, 4)
    mask[:, -1] = 0
    ids[:, -1] = -100  # padding under the mask
    out = polykernel.fused_linear_grpo_loss(hid, w, ids, mask, torch.randn(2), b, beta=0.0)
    assert torch.isfinite(out.loss)
    ids[0, 0] = 30  # a scored id out of range
    with pytest.raises(OpArgumentError) as info:
        polykernel.fused_linear_grpo_loss(hid, w, ids, mask, torch.randn(2), b, beta=0.0)
    assert info.value.arg == "selected_token_ids"


# -- on the GPU (H200: -m gpu) --------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton", "torch", "liger"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_dpo_and_grpo_match_the_float64_formulas(impl, dtype, monkeypatch):
    monkeypatch.setattr(_linear_logps, "CHUNK_BYTES", 256 << 20)  # several chunks at this size
    r, t, h, v = 8, 256, 512, 32000
    hid = torch.randn(r, t, h, device="cuda").to(dtype).requires_grad_()
    w = (torch.randn(v, h, device="cuda") * 2 / h**0.5).to(dtype).requires_grad_()
    tg = torch.randint(0, v, (r, t), device="cuda").masked_fill(torch.rand(r, t, device="cuda") < 0.1, -100)
    out = polykernel.fused_linear_dpo_loss(hid, w, tg, impl=impl, compute_nll_loss=True)
    want = dpo_formula(hid, w, None, tg, nll=True)
    # liger rounds its logits to bf16 before the log-softmax; ours are fp32 GEMM outputs
    rtol = 2e-2 if (impl == "liger" and dtype == torch.bfloat16) else 1e-4
    torch.testing.assert_close(out.loss.double(), want[0].detach(), rtol=rtol, atol=rtol)
    assert_grads(out.loss, want[0], (hid, w), torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)
    ids, mask, adv = (
        torch.randint(0, v, (r, t), device="cuda"),
        (torch.rand(r, t, device="cuda") > 0.1).long(),
        torch.randn(r, device="cuda"),
    )
    with torch.no_grad():
        lp, _ = token_logps(hid, w, None, ids, ignore=-(10**9))
    old, ref = (lp + 0.1 * torch.randn_like(lp)).float(), (lp + 0.1 * torch.randn_like(lp)).float()
    if impl == "liger" and dtype != torch.float32:  # its 16-bit gradients missed the error model here
        with pytest.raises(ImplNotAvailableError, match="float32 only"):
            polykernel.fused_linear_grpo_loss(hid, w, ids, mask, adv, ref_per_token_logps=ref, old_per_token_logps=old, impl=impl)
        return
    out = polykernel.fused_linear_grpo_loss(hid, w, ids, mask, adv, ref_per_token_logps=ref, old_per_token_logps=old, impl=impl)
    want = grpo_formula(hid, w, None, ids, mask, adv, ref=ref, old=old)
    torch.testing.assert_close(out.loss.double(), want.detach(), rtol=rtol, atol=rtol)
    assert_grads(out.loss, want, (hid, w), torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)


@settings(max_examples=10, deadline=None)
@given(
    b=st.integers(1, 3), t=st.integers(1, 8), v=st.integers(2, 60), impl=st.sampled_from(IMPLS),  # (V = 1: ORPO log1p(-1))
    name=st.sampled_from(["orpo", "cpo", "simpo", "kto"]), ignored=st.sampled_from([0.0, 0.3]),
)  # fmt: skip
def test_pairwise_and_kto_hypothesis_shapes(b, t, v, impl, name, ignored):
    hid, w, bias = head(2 * b, t, 8, v)
    tg = targets(2 * b, t, v, ignored=ignored)
    tg[:, 0] = torch.randint(0, v, (2 * b,))  # every row scores a token: the average log-probs stay finite
    if name == "kto":
        labels = torch.rand(2 * b) > 0.5
        out = polykernel.fused_linear_kto_loss(hid, w, tg, labels, bias, kl=0.1, impl=impl)
        want = kto_formula(hid, w, bias, tg, labels, kl=0.1)[0]
    else:
        fn, formula = {"orpo": ("fused_linear_orpo_loss", orpo_formula), "cpo": ("fused_linear_cpo_loss", cpo_formula),
                       "simpo": ("fused_linear_simpo_loss", simpo_formula)}[name]  # fmt: skip
        out = getattr(polykernel, fn)(hid, w, tg, bias, impl=impl)
        want = formula(hid, w, bias, tg)[0]
    torch.testing.assert_close(out.loss.double(), want.detach(), rtol=2e-5, atol=2e-5)
    assert_grads(out.loss, want, (hid, w, bias), torch.float32)


# -- the parity harness (each op's error model, against its float64 reference) ---------------------

OPS = [f"fused_linear_{n}_loss" for n in ("dpo", "orpo", "cpo", "simpo", "kto", "grpo")]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", OPS)
def test_parity_on_the_op_cases(name, impl):
    results = check_parity(name, [impl], dtypes=[torch.float32, torch.bfloat16, torch.float16])
    assert results and all(r.ok for r in results), "\n".join(str(r) for r in results if not r.ok)


@settings(max_examples=12, deadline=None)
@given(
    r=st.integers(1, 3), t=st.integers(1, 7), h=st.integers(1, 24), v=st.integers(1, 120), ignored=st.sampled_from([0.0, 0.3, 1.0]),
    impl=st.sampled_from(IMPLS), dtype=st.sampled_from([torch.float32, torch.bfloat16]), beta=st.sampled_from([0.0, 0.1, 2.0]),
)  # fmt: skip
def test_dpo_parity_hypothesis(r, t, h, v, ignored, impl, dtype, beta):
    args = pref.case_head(2 * r, t, h, v, device="cpu", dtype=dtype, ignored=ignored)
    (result,) = check_parity("fused_linear_dpo_loss", [impl], dtypes=[dtype], cases=[Case("drawn", args, {"beta": beta})])
    assert result.ok, str(result)


@settings(max_examples=12, deadline=None)
@given(
    b=st.integers(1, 4), t=st.integers(1, 7), v=st.integers(1, 120), impl=st.sampled_from(IMPLS),
    level=st.sampled_from(["token", "sequence"]), loss_type=st.sampled_from(["grpo", "bnpo", "dr_grpo", "dapo"]),
)  # fmt: skip
def test_grpo_parity_hypothesis(b, t, v, impl, level, loss_type):
    h, w, ids, bias = pref.case_head(b, t, 16, v, device="cpu", dtype=torch.float32, ignored=0.0)
    args, kw = grpo_op._completions(h, w, ids, bias, "cpu")
    case = Case("drawn", args, dict(kw, loss_type=loss_type, importance_sampling_level=level))
    (result,) = check_parity("fused_linear_grpo_loss", [impl], dtypes=[torch.float32], cases=[case])
    assert result.ok, str(result)


@pytest.mark.parametrize(("where", "factor"), [("loss", 1 + 1e-4), ("grad", 1 + 5e-2)])
def test_the_error_model_catches_a_small_error(monkeypatch, where, factor):
    # fp32: the model's bound is well below these relative errors, so a kernel that makes them fails
    from polykernel.backends.torch import _token_logps

    if where == "loss":
        real = _linear_logps.walk

        def walk(*a, **k):
            loss, *rest = real(*a, **k)
            return (loss * factor, *rest)

        monkeypatch.setattr(_linear_logps, "walk", walk)
    else:
        real = _token_logps.token_grad_

        def token_grad_(z, tc, lse, scale, dz, ignore_index):
            return real(z, tc, lse, scale * factor, dz, ignore_index)

        monkeypatch.setattr(_token_logps, "token_grad_", token_grad_)
    case = next(c for c in registry.get_op("fused_linear_dpo_loss").cases("cpu", torch.float32) if c.label == "4x6x16x97")
    (result,) = check_parity("fused_linear_dpo_loss", ["torch"], dtypes=[torch.float32], cases=[case])
    assert not result.ok and (result.forward_error if where == "loss" else result.backward_error) > 1


def test_dispatcher_resolution_order_and_explain():
    hid, w, b = head(4, 3, 8, 20)
    t = targets(4, 3, 20)
    e = polykernel.explain("fused_linear_dpo_loss", hid, w, t, b)
    assert e.chosen == ("triton" if polykernel.env.triton_interpret() else "torch")
    assert {r["name"] for r in e.impls} == {"torch", "triton", "liger"}
    with polykernel.use_impl("torch"):
        polykernel.fused_linear_dpo_loss(hid, w, t, b)
    assert [d["impl"] for d in polykernel.decisions("fused_linear_dpo_loss")][-1] == "torch"
    # Liger's refusal of precomputed reference log-probs is a reason in explain, never a fault
    e = polykernel.explain("fused_linear_dpo_loss", hid, w, t, b, ref_chosen_logps=torch.zeros(2), ref_rejected_logps=torch.zeros(2))
    reasons = {r["name"]: r["reason"] for r in e.impls}
    assert reasons["liger"] is not None


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["fused_linear_dpo_loss", "fused_linear_grpo_loss"])
def test_gpu_parity_large(name):
    results = check_parity(name, device="cuda", dtypes=[torch.bfloat16], large=True)
    assert results and all(r.ok for r in results), "\n".join(str(r) for r in results if not r.ok)


def test_grpo_bias_correction_changes_the_kl_gradient_on_policy():
    # on-policy (old = the policy's own): the ratio is 1, the loss the same, but its gradient is not
    hid, w, b = head(2, 5, 8, 30)
    ids, mask, adv = torch.randint(0, 30, (2, 5)), torch.ones(2, 5), torch.randn(2)
    ref = -torch.rand(2, 5) * 4
    plain = polykernel.fused_linear_grpo_loss(hid, w, ids, mask, adv, b, ref_per_token_logps=ref, beta=0.5)
    weighted = polykernel.fused_linear_grpo_loss(hid, w, ids, mask, adv, b, ref_per_token_logps=ref, beta=0.5, use_bias_correction_kl=True)
    torch.testing.assert_close(plain.loss, weighted.loss)
    (g1,), (g2,) = torch.autograd.grad(plain.loss, [hid]), torch.autograd.grad(weighted.loss, [hid])
    assert (g1 - g2).abs().max() > 1e-3 * g1.abs().max()
    with pytest.raises(OpArgumentError) as info:
        polykernel.fused_linear_grpo_loss(hid, w, ids, mask, adv, b, ref_per_token_logps=ref, use_bias_correction_kl=1)
    assert info.value.arg == "use_bias_correction_kl"


@pytest.mark.parametrize("name", ["dpo", "orpo", "cpo", "simpo", "kto", "grpo"])
def test_public_function_states_the_references_arguments(name):
    # the public function (options keyword-only) and the reference (all positional, the Op's
    # order) each state the arguments and their defaults: they must agree, or a default call
    # would run other options than the reference, explain and the argument class assume
    import inspect

    op = registry.get_op(f"fused_linear_{name}_loss")
    public = inspect.signature(getattr(polykernel, f"fused_linear_{name}_loss")).parameters
    ref = inspect.signature(op.reference).parameters
    assert [n for n in public if n != "impl"] == list(ref)
    assert {n: p.default for n, p in public.items() if n != "impl"} == {n: p.default for n, p in ref.items()}
    assert op.fields == ("device", "dtype", "needs_grad", *ref)  # pref.op_fields: the class names every argument
