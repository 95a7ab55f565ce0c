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
