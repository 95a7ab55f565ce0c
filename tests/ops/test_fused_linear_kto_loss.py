"""loss.fused_linear_kto_loss: against the float64 KTO formula, forward and backward, on every impl
runnable on the CPU, with chunks forced small; reference log-probs or head, bad input, the module
(the losses' shared driver: test_preference_losses.py)."""

from __future__ import annotations

import pytest
import torch

import polykernel
from _preference_helpers import (
    IMPLS,
    assert_grads,
    head,
    kto_formula,
    small_chunks,  # noqa: F401  (autouse: small chunks in this module too)
    targets,
    token_logps,
)
from polykernel.errors import OpArgumentError
from polykernel.testing import check_parity


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


def test_kto_nn_module():
    hid, w, b = head(3, 3, 8, 20)
    t, labels = targets(3, 3, 20), torch.tensor([True, False, False])
    m = polykernel.nn.FusedLinearKTOLoss(beta=0.3)
    torch.testing.assert_close(
        m(hid, w, t, labels, b, kl=0.1).loss, polykernel.fused_linear_kto_loss(hid, w, t, labels, b, kl=0.1, beta=0.3).loss
    )


@pytest.mark.parametrize("impl", IMPLS)
def test_parity_on_the_op_cases(impl):
    results = check_parity("fused_linear_kto_loss", [impl], dtypes=[torch.float32, torch.bfloat16, torch.float16])
    assert results and all(r.ok for r in results), "\n".join(str(r) for r in results if not r.ok)


@pytest.mark.gpu
def test_gpu_parity_large():
    results = check_parity("fused_linear_kto_loss", device="cuda", dtypes=[torch.bfloat16], large=True)
    assert results and all(r.ok for r in results), "\n".join(str(r) for r in results if not r.ok)
