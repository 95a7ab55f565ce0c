"""loss.fused_linear_dpo_loss: against the float64 DPO formula (TRL's), forward and backward, on every impl
runnable on the CPU, with chunks forced small; bf16, ignored rows, the op's error model, bad input,
explain (the losses' shared driver: test_preference_losses.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import polykernel
from _preference_helpers import (
    IMPLS,
    assert_grads,
    dpo_formula,
    head,
    small_chunks,  # noqa: F401  (autouse: small chunks in this module too)
    targets,
    token_logps,
)
from polykernel.backends import _linear_logps
from polykernel.core import registry
from polykernel.core.op import Case
from polykernel.errors import OpArgumentError, UnknownImplError
from polykernel.ops import _preference as pref
from polykernel.ops import fused_linear_dpo_loss as dpo_op
from polykernel.testing import check_parity


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


@pytest.mark.parametrize("impl", IMPLS)
def test_parity_on_the_op_cases(impl):
    results = check_parity("fused_linear_dpo_loss", [impl], dtypes=[torch.float32, torch.bfloat16, torch.float16])
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


@pytest.mark.parametrize(("where", "factor"), [("loss", 1 + 1e-4), ("grad", 1 + 5e-2)])
def test_the_error_model_catches_a_small_error(monkeypatch, where, factor):
    # fp32: the model's bound is well below these relative errors, so a kernel that makes them fails
    from polykernel.backends import _token_logps

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
def test_gpu_parity_large():
    results = check_parity("fused_linear_dpo_loss", device="cuda", dtypes=[torch.bfloat16], large=True)
    assert results and all(r.ok for r in results), "\n".join(str(r) for r in results if not r.ok)
