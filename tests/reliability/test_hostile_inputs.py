"""Inputs a careless or hostile caller passes (issue 27's probe): each gets PyTorch's answer or an
error that names the op and the argument, never a silently wrong result or an internal error."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import polykernel as pk
from polykernel.errors import OpArgumentError
from polykernel.ops.cross_entropy import reference as ce_reference
from polykernel.ops.fused_linear_cross_entropy import reference as flce_reference
from polykernel.testing import runnable_impls


def _need(op, impl, dtype=torch.float32):
    if impl not in runnable_impls(op, "cpu", dtype):
        pytest.skip(f"{impl} not runnable on the CPU here")


# -- float64 with label smoothing: gradients as accurate as float64 ---------------------------------


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_cross_entropy_float64_smoothed_gradient_is_float64_accurate(reduction):
    # -(1 - ε) was made an fp32 tensor: 2.7e-8 relative error where fp64 gives ~1e-16
    x = torch.randn(8, 50, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 50, (8,))
    dy = torch.rand(8, dtype=torch.float64) if reduction == "none" else torch.tensor(1.0, dtype=torch.float64)
    (got,) = torch.autograd.grad(pk.cross_entropy(x, t, label_smoothing=0.1, reduction=reduction, impl="torch"), x, dy)
    (want,) = torch.autograd.grad(ce_reference(x, t, label_smoothing=0.1, reduction=reduction), x, dy)
    assert _rel(got, want) < 1e-13


def test_fused_linear_cross_entropy_float64_smoothed_gradient_is_float64_accurate():
    h = torch.randn(8, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 50, (8,))
    got = torch.autograd.grad(pk.fused_linear_cross_entropy(h, w, t, label_smoothing=0.3, impl="torch"), (h, w))
    want = torch.autograd.grad(flce_reference(h, w, t, label_smoothing=0.3), (h, w))
    for g, r in zip(got, want):
        assert _rel(g, r) < 1e-13


# -- an in-place edit of a reduction="none" loss, as F.cross_entropy allows -------------------------


def _edit(loss):
    loss.mul_(2)
    loss[0] = 0
    return loss.sum()


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_cross_entropy_none_loss_can_be_edited_in_place(impl):
    _need("cross_entropy", impl)
    x, t = torch.randn(2, 3, 7, requires_grad=True), torch.randint(0, 7, (2, 3))
    (got,) = torch.autograd.grad(_edit(pk.cross_entropy(x, t, reduction="none", impl=impl)), x)
    (want,) = torch.autograd.grad(_edit(F.cross_entropy(x.transpose(1, 2), t, reduction="none")), x)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_fused_linear_cross_entropy_none_loss_can_be_edited_in_place(impl):
    _need("fused_linear_cross_entropy", impl)
    h, w, t = torch.randn(2, 3, 8, requires_grad=True), torch.randn(7, 8, requires_grad=True), torch.randint(0, 7, (2, 3))
    got = torch.autograd.grad(_edit(pk.fused_linear_cross_entropy(h, w, t, reduction="none", impl=impl)), (h, w))
    want = torch.autograd.grad(_edit(F.cross_entropy(F.linear(h, w).transpose(1, 2), t, reduction="none")), (h, w))
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r)


def test_liger_none_losses_can_be_edited_in_place():
    # The Liger adapters, called directly (the dispatcher offers them on CUDA only): their
    # kernels run in Triton's interpreter.
    pytest.importorskip("liger_kernel")
    from polykernel.backends.liger.cross_entropy import cross_entropy as liger_ce
    from polykernel.backends.liger.fused_linear_cross_entropy import fused_linear_cross_entropy as liger_flce

    x, t = torch.randn(2, 3, 7, requires_grad=True), torch.randint(0, 7, (2, 3))
    (got,) = torch.autograd.grad(_edit(liger_ce(x, t, -100, 0.0, "none")), x)
    (want,) = torch.autograd.grad(_edit(F.cross_entropy(x.transpose(1, 2), t, reduction="none")), x)
    torch.testing.assert_close(got, want)
    h, w = torch.randn(2, 3, 8, requires_grad=True), torch.randn(7, 8, requires_grad=True)
    got = torch.autograd.grad(_edit(liger_flce(h, w, t, None, -100, 0.0, "none")), (h, w))
    want = torch.autograd.grad(_edit(F.cross_entropy(F.linear(h, w).transpose(1, 2), t, reduction="none")), (h, w))
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r)


# -- the fused linear CE with hidden size 0 and under autocast --------------------------------------


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_fused_linear_cross_entropy_hidden_size_zero_is_pytorchs(impl, bias):
    # F.linear of H = 0 gives logits = bias (or 0): a valid loss (log V without a bias)
    _need("fused_linear_cross_entropy", impl)
    h, w = torch.randn(2, 3, 0, requires_grad=True), torch.randn(5, 0, requires_grad=True)
    b = torch.randn(5, requires_grad=True) if bias else None
    t = torch.tensor([[0, 4, -100], [2, 2, 1]])
    inputs = (h, w) + ((b,) if bias else ())
    loss = pk.fused_linear_cross_entropy(h, w, t, b, impl=impl)
    want = F.cross_entropy(F.linear(h, w, b).reshape(-1, 5), t.reshape(-1))
    torch.testing.assert_close(loss, want)
    if not bias:
        torch.testing.assert_close(loss, torch.tensor(5.0).log())
    for g, r in zip(torch.autograd.grad(loss, inputs), torch.autograd.grad(want, inputs)):
        assert g.shape == r.shape
        torch.testing.assert_close(g, r)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_fused_linear_cross_entropy_under_cpu_autocast(impl, reduction):
    # As F.linear under autocast: the matmuls in bf16, the loss fp32, gradients in the inputs' dtype
    _need("fused_linear_cross_entropy", impl, torch.bfloat16)
    h, w, b = torch.randn(6, 16, requires_grad=True), torch.randn(40, 16, requires_grad=True), torch.randn(40, requires_grad=True)
    t = torch.randint(0, 40, (6,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = pk.fused_linear_cross_entropy(h, w, t, b, reduction=reduction, impl=impl)
        want = F.cross_entropy(F.linear(h, w, b), t, reduction=reduction)
    assert loss.dtype == want.dtype == torch.float32
    torch.testing.assert_close(loss, want, rtol=1e-2, atol=1e-2)
    got_g = torch.autograd.grad(loss.sum(), (h, w, b))
    want_g = torch.autograd.grad(want.sum(), (h, w, b))
    for g, r, x in zip(got_g, want_g, (h, w, b)):
        assert g.dtype == x.dtype == torch.float32
        torch.testing.assert_close(g, r, rtol=2e-2, atol=2e-2)


# -- option values too large for the kernels' types: named errors from validation ------------------

HUGE = 10**400  # an int that no float holds


@pytest.mark.parametrize(
    "call, arg",
    [
        (lambda: pk.rms_norm(torch.randn(2, 8), torch.ones(8), eps=HUGE), "eps"),
        (lambda: pk.rms_norm(torch.randn(2, 8), torch.ones(8), eps=10**30), "eps"),
        (lambda: pk.rms_norm(torch.randn(2, 8), torch.ones(8), offset=HUGE), "offset"),
        (lambda: pk.rms_norm(torch.randn(2, 8), torch.ones(8), offset=-HUGE), "offset"),
        (lambda: pk.layer_norm(torch.randn(2, 8), eps=HUGE), "eps"),
        (lambda: pk.fused_add_rms_norm(torch.randn(2, 8), torch.randn(2, 8), torch.ones(8), eps=HUGE), "eps"),
        (lambda: pk.fused_add_rms_norm(torch.randn(2, 8), torch.randn(2, 8), torch.ones(8), offset=HUGE), "offset"),
        (lambda: pk.cross_entropy(torch.randn(2, 8), torch.tensor([1, 2]), ignore_index=10**30), "ignore_index"),
        (lambda: pk.cross_entropy(torch.randn(2, 8), torch.tensor([1, 2]), ignore_index=-(2**63) - 1), "ignore_index"),
        (
            lambda: pk.fused_linear_cross_entropy(torch.randn(2, 4), torch.randn(8, 4), torch.tensor([1, 2]), ignore_index=2**63),
            "ignore_index",
        ),
    ],
)
def test_out_of_range_options_are_named_errors(call, arg):
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="polykernel")  # the fault path: an impl marked broken
        with pytest.raises(OpArgumentError, match=rf"argument '{arg}'") as info:
            call()
    assert len(str(info.value)) < 300  # a huge value is shown cut


def test_int64_edge_ignore_index_still_works():
    x, t = torch.randn(3, 8, requires_grad=True), torch.tensor([1, 2, 3])
    for ii in (2**63 - 1, -(2**63)):
        torch.testing.assert_close(pk.cross_entropy(x, t, ignore_index=ii), F.cross_entropy(x, t))


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_int_options_within_int64_work(impl):
    # An int eps/offset reaches the kernels as an integer argument: within int64 it works (and
    # auto selection sees no fault); beyond it the reference's own `x + eps` overflows, so
    # validation names it (above).
    _need("rms_norm", impl)
    x, w, r = torch.randn(2, 8), torch.ones(8), torch.randn(2, 8)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="polykernel")
        for call in (
            lambda i: pk.rms_norm(x, w, eps=2**40, offset=2**62, impl=i),
            lambda i: pk.layer_norm(x, w, eps=2**62, impl=i),
            lambda i: pk.fused_add_rms_norm(x, r, w, eps=1, offset=-(2**62), impl=i),
        ):
            got, want = call(impl), call("torch")
            for g, r_ in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
                torch.testing.assert_close(g, r_)
            call(None)  # auto selection: no fault
