"""polykernel.nn as a drop-in for the module each class names (torch.nn's, Liger's, transformers'):
the same constructor arguments and defaults, the same answers on the inputs that module takes, and
a clear error (never another answer) where ours does not take them. test_nn.py has the rest."""

from __future__ import annotations

import pytest
import torch

import polykernel.nn as pnn


def leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64], ids=str)
def test_rmsnorm_default_eps_is_torch_nn_rmsnorms(dtype):
    # torch.nn.RMSNorm's eps=None is finfo(math dtype).eps (fp32's for bf16); a fixed 1e-6 moved
    # small-scale rows by tens of percent (rms 1e-3: 0.62 absolute in fp32)
    ours, theirs = pnn.RMSNorm(16, dtype=dtype), torch.nn.RMSNorm(16, dtype=dtype)
    assert ours.eps is None and repr(ours) == "RMSNorm((16,), eps=None, casting='fp32')"
    theirs.load_state_dict(ours.state_dict())
    x = 1e-3 * torch.randn(4, 16, dtype=dtype)
    xa, xb = leaf(x), leaf(x)
    ya, yb = ours(xa), theirs(xb)
    torch.testing.assert_close(ya, yb)
    g = torch.randn_like(ya)
    torch.testing.assert_close(torch.autograd.grad(ya, xa, g)[0], torch.autograd.grad(yb, xb, g)[0])
    # the fused residual path takes the same eps
    r = torch.randn(4, 16, dtype=dtype) * 1e-3
    torch.testing.assert_close(ours(x, r)[0], theirs(x + r))


@pytest.mark.parametrize("impl", [None, "torch", "triton"])
def test_softmax_takes_torch_nn_softmaxs_dim(impl):
    from polykernel.testing import runnable_impls

    if impl is not None and impl not in runnable_impls("softmax", "cpu", torch.float32):
        pytest.skip(f"softmax: impl {impl!r} cannot run on the CPU here")
    x = torch.randn(3, 5, 4)
    for dim in (0, 1, 2, -1, -2):
        ours, theirs = pnn.Softmax(dim=dim, impl=impl), torch.nn.Softmax(dim=dim)
        assert repr(ours) == f"Softmax(dim={dim}{'' if impl is None else f', impl={impl!r}'})"
        xa, xb = leaf(x), leaf(x)
        ya, yb = ours(xa), theirs(xb)
        torch.testing.assert_close(ya, yb)
        g = torch.randn_like(ya)
        torch.testing.assert_close(torch.autograd.grad(ya, xa, g)[0], torch.autograd.grad(yb, xb, g)[0])
    torch.testing.assert_close(pnn.Softmax(1)(x), torch.softmax(x, 1))  # positional, as torch's
    with pytest.raises(IndexError):
        pnn.Softmax(dim=3)(x)
    with pytest.raises(TypeError, match="dim=None"):
        pnn.Softmax(dim=None)


@pytest.mark.parametrize("affine", [True, False])
def test_groupnorm_takes_torch_nn_groupnorms_bias(affine):
    import inspect

    if "bias" not in inspect.signature(torch.nn.GroupNorm).parameters:
        pytest.skip("this torch's GroupNorm has no bias= (torch >= 2.13)")
    theirs = torch.nn.GroupNorm(2, 6, affine=affine, bias=False)
    ours = pnn.GroupNorm(2, 6, affine=affine, bias=False)
    assert ours.bias is None and (ours.weight is not None) == affine
    if affine:
        with torch.no_grad():
            theirs.weight.copy_(1 + 0.1 * torch.randn(6))
        assert repr(ours) == "GroupNorm(2, 6, eps=1e-05, affine=True, bias=False)"
    ours.load_state_dict(theirs.state_dict())  # the same keys: no bias
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(3, 6, 5)
    xa, xb = leaf(x), leaf(x)
    ya, yb = ours(xa), theirs(xb)
    torch.testing.assert_close(ya, yb)
    g = torch.randn_like(ya)
    pa, pb = [xa, *ours.parameters()], [xb, *theirs.parameters()]
    for a, b in zip(torch.autograd.grad(ya, pa, g), torch.autograd.grad(yb, pb, g)):
        torch.testing.assert_close(a, b)
    ours.reset_parameters()
    assert not affine or torch.equal(ours.weight, torch.ones(6))


@pytest.mark.parametrize("cls, name", [(pnn.CrossEntropyLoss, "weight"), (pnn.FusedLinearCrossEntropyLoss, "ce_weight")])
def test_ce_modules_name_the_weight_keyword_for_torchs_positional_weight(cls, name):
    # torch.nn.CrossEntropyLoss(w) and Liger's take the class weights first; ours take ignore_index
    # first, so the error says where the weights go (it named only ignore_index)
    with pytest.raises(TypeError, match=rf"ignore_index.*keyword {name}="):
        cls(torch.rand(5))
    assert torch.equal(getattr(cls(**{name: torch.ones(5)}), name), torch.ones(5))


def test_layernorm_without_weight_refuses_another_last_dim():
    # torch.nn.LayerNorm(5, elementwise_affine=False) refuses x [..., 4]; ours normalized it over 4
    with pytest.raises(RuntimeError):
        torch.nn.LayerNorm(5, elementwise_affine=False)(torch.randn(2, 4))
    for bad in (torch.randn(2, 4), torch.randn(5, 2), torch.tensor(1.0)):
        with pytest.raises(ValueError, match=r"LayerNorm.*last dim of 5"):
            pnn.LayerNorm(5, elementwise_affine=False)(bad)
    x = torch.randn(2, 5)
    torch.testing.assert_close(pnn.LayerNorm(5, elementwise_affine=False)(x), torch.nn.LayerNorm(5, elementwise_affine=False)(x))
