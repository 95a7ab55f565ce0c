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


def test_the_ratio_walks_large_tensors_in_row_blocks_with_the_same_answer(monkeypatch):
    """An LM head's gradient (10^9 elements) is compared block by block (float64 temporaries of
    RATIO_ELEMENTS, not several whole copies): the worst ratio, the tolerance's scale (the largest
    reference value, whichever block holds it) and the non-finite checks are the whole tensor's."""
    from types import SimpleNamespace

    from polykernel import testing

    torch.manual_seed(0)
    ref = torch.randn(64, 33, dtype=torch.float64)
    ref[50, 3] = 40.0  # the scale lives in a late block
    out = (ref + 1e-3 * torch.randn_like(ref)).float()
    out[7, 2] += 0.5  # the worst error in an early block
    tol_of = lambda scale: SimpleNamespace(atol=1e-3 * scale, rtol=1e-3)
    whole = testing._ratio(out, out, ref, tol_of)
    bad = out.clone()
    bad[60, 0] = float("nan")
    rows_ref = ref.clone()
    rows_ref[9, 4] = float("inf")  # with nonfinite_rows: row 9 may be NaN anywhere
    rows_out = out.clone()
    rows_out[9] = float("nan")
    rows_whole = testing._ratio(rows_out, rows_out, rows_ref, tol_of, nonfinite_rows=True)
    monkeypatch.setattr(testing, "RATIO_ELEMENTS", 2 * 33)  # two rows a block: 32 blocks
    assert testing._ratio(out, out, ref, tol_of) == whole and whole[0] > 1
    assert testing._ratio(bad, bad, ref, tol_of)[0] == float("inf")
    assert testing._ratio(rows_out, rows_out, rows_ref, tol_of, nonfinite_rows=True) == rows_whole
    assert rows_whole[0] < float("inf")
