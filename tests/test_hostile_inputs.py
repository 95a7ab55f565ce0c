"""Inputs a careless or hostile caller passes (issue 27's probe): each gets PyTorch's answer or an
error that names the op and the argument, never a silently wrong result or an internal error."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import polykernel as pk
from polykernel.errors import OpArgumentError
from polykernel.testing import runnable_impls


def _need(op, impl, dtype=torch.float32):
    if impl not in runnable_impls(op, "cpu", dtype):
        pytest.skip(f"{impl} not runnable on the CPU here")


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
