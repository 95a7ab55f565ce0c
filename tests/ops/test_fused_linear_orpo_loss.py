"""loss.fused_linear_orpo_loss: against its float64 formula (the paper's), forward and backward, on every impl
runnable on the CPU, with chunks forced small; bf16, bad input, the module (the losses' shared
driver: test_preference_losses.py)."""

from __future__ import annotations

import pytest
import torch

import polykernel
from _preference_helpers import (
    IMPLS,
    assert_grads,
    head,
    orpo_formula,
    small_chunks,  # noqa: F401  (autouse: small chunks in this module too)
    targets,
)
from polykernel.errors import OpArgumentError
from polykernel.testing import check_parity

# (options, the formula's options)
OPTIONS = [
    ({}, {}),
    ({"beta": 0.5, "compute_nll_loss": False}, {"beta": 0.5, "nll": False}),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("kw", "fkw"), OPTIONS, ids=["plain", "beta-no-nll"])
def test_matches_formula(impl, kw, fkw):
    hid, w, b = head(6, 7, 16, 97)
    t = targets(6, 7, 97)
    out = polykernel.fused_linear_orpo_loss(hid, w, t, b, impl=impl, **kw)
    want = orpo_formula(hid, w, b, t, **fkw)
    assert len(out) == len(want) and out._fields[:3] == ("loss", "chosen_logps", "rejected_logps")
    for got, exp in zip(out, want):
        torch.testing.assert_close(got.double(), exp.detach().double(), rtol=2e-5, atol=2e-5)
    assert_grads(out.loss, want[0], (hid, w, b), torch.float32)


def test_bad_input_names_the_argument():
    hid, w, b = head(3, 3, 8, 20)
    with pytest.raises(OpArgumentError) as info:
        polykernel.fused_linear_orpo_loss(hid, w, targets(3, 3, 20), b)
    assert info.value.op == "loss.fused_linear_orpo_loss" and info.value.arg == "hidden" and "2B" in str(info.value)
    hid, w, b = head(4, 3, 8, 20)
    with pytest.raises(OpArgumentError) as info:
        polykernel.fused_linear_orpo_loss(hid, w, targets(4, 3, 20), b, beta=-1.0)
    assert info.value.op == "loss.fused_linear_orpo_loss" and info.value.arg == "beta"


@pytest.mark.parametrize("impl", IMPLS)
def test_bf16(impl):
    hid, w, b = head(4, 5, 32, 300, dtype=torch.bfloat16)
    t = targets(4, 5, 300)
    out = polykernel.fused_linear_orpo_loss(hid, w, t, b, impl=impl)
    want = orpo_formula(hid, w, b, t)
    torch.testing.assert_close(out.loss.double(), want[0].detach(), rtol=1e-4, atol=1e-4)
    assert_grads(out.loss, want[0], (hid, w, b), torch.bfloat16)


def test_nn_module():
    hid, w, b = head(4, 3, 8, 20)
    t = targets(4, 3, 20)
    m = polykernel.nn.FusedLinearORPOLoss(beta=0.3)
    torch.testing.assert_close(m(hid, w, t, b).loss, polykernel.fused_linear_orpo_loss(hid, w, t, b, beta=0.3).loss)


@pytest.mark.parametrize("impl", IMPLS)
def test_parity_on_the_op_cases(impl):
    results = check_parity("fused_linear_orpo_loss", [impl], dtypes=[torch.float32, torch.bfloat16, torch.float16])
    assert results and all(r.ok for r in results), "\n".join(str(r) for r in results if not r.ok)


@pytest.mark.gpu
def test_gpu_parity_large():
    results = check_parity("fused_linear_orpo_loss", device="cuda", dtypes=[torch.bfloat16], large=True)
    assert results and all(r.ok for r in results), "\n".join(str(r) for r in results if not r.ok)
