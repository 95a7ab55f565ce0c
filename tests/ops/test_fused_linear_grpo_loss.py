"""loss.fused_linear_grpo_loss: against TRL 1.16's GRPO loss (transcribed), forward, backward and metrics,
on every impl runnable on the CPU, with chunks forced small; every loss type and level, masks,
awkward vocabularies, bad input (the losses' shared driver: test_preference_losses.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import polykernel
from _preference_helpers import (
    IMPLS,
    assert_grads,
    grpo_formula,
    head,
    small_chunks,  # noqa: F401  (autouse: small chunks in this module too)
    token_logps,
)
from polykernel.core.op import Case
from polykernel.errors import OpArgumentError
from polykernel.ops import _preference as pref
from polykernel.ops import fused_linear_grpo_loss as grpo_op
from polykernel.testing import check_parity

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


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("v", [1, 2, 1025])
def test_awkward_vocabularies(impl, v):
    hid, w, b = head(3, 4, 8, v)
    ids, mask, adv = torch.randint(0, v, (3, 4)), torch.ones(3, 4), torch.randn(3)
    out = polykernel.fused_linear_grpo_loss(hid, w, ids, mask, adv, b, beta=0.0, impl=impl)
    want = grpo_formula(hid, w, b, ids, mask, adv, beta=0.0)
    torch.testing.assert_close(out.loss.double(), want.detach(), rtol=2e-5, atol=2e-6)
    assert_grads(out.loss, want, (hid, w, b), torch.float32)


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


@pytest.mark.parametrize("impl", IMPLS)
def test_parity_on_the_op_cases(impl):
    results = check_parity("fused_linear_grpo_loss", [impl], dtypes=[torch.float32, torch.bfloat16, torch.float16])
    assert results and all(r.ok for r in results), "\n".join(str(r) for r in results if not r.ok)


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


@pytest.mark.gpu
def test_gpu_parity_large():
    results = check_parity("fused_linear_grpo_loss", device="cuda", dtypes=[torch.bfloat16], large=True)
    assert results and all(r.ok for r in results), "\n".join(str(r) for r in results if not r.ok)
