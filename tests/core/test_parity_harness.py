"""The parity harness (polykernel.testing) on impls that cannot run here and names an op lacks."""

from __future__ import annotations

import pytest
import torch

from polykernel.errors import UnknownImplError
from polykernel.testing import assert_parity, check_parity


def test_an_impl_that_cannot_run_here_is_skipped_with_the_reason_not_failed():
    results = check_parity("rms_norm", ["cute_dsl"], device="cpu", dtypes=[torch.float32])  # CPU tensors: needs CUDA
    assert results and all(r.skipped == "needs a CUDA device" and not r.ok for r in results)
    assert all(str(r).startswith("skip norm.rms_norm [cute_dsl] ") for r in results)


def test_assert_parity_fails_on_an_impl_that_could_not_run():
    with pytest.raises(AssertionError, match="not available here: needs a CUDA device"):
        assert_parity("rms_norm", ["cute_dsl"], device="cpu", dtypes=[torch.float32])


@pytest.mark.parametrize("op,impls", [("rms_norm", ["tritonn"]), ("swiglu", ["torch", "cuda_jit"])])  # swiglu has no cuda_jit
def test_a_name_the_op_lacks_is_an_error_listing_its_impls(op, impls):
    with pytest.raises(UnknownImplError, match=r"check_parity\(impls=\): no .* impl is registered for this op; its impls are: .*torch"):
        check_parity(op, impls, device="cpu", dtypes=[torch.float32])


def test_one_name_as_a_string_is_one_impl():
    results = check_parity("swiglu", "torch", device="cpu", dtypes=[torch.float32])
    assert results and {r.impl for r in results} == {"torch"} and all(r.ok for r in results)
