"""Hypothesis settings of the per-op property tests (tests/ops/test_<op>.py), as the reliability
suite has them (tests/reliability/test_reliability_parity.py): derandomized, no database, no
deadline (the interpreter's first compile of a kernel is slow). ``POLYKERNEL_HYPOTHESIS_EXAMPLES``
sets the number of examples; the defaults are small, for the CPU interpreter."""

from __future__ import annotations

import os

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from polykernel.core.op import Case
from polykernel.testing import check_parity, refusal


def examples(default: int) -> int:
    raw = os.environ.get("POLYKERNEL_HYPOTHESIS_EXAMPLES", "").strip()
    return int(raw) if raw.isdigit() and int(raw) > 0 else default


def property_settings(default: int) -> settings:
    return settings(
        max_examples=examples(default),
        derandomize=True,  # the same examples on every run (hypothesis' seed from the test's name)
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        print_blob=True,
    )


def layout(t: torch.Tensor, how: str) -> torch.Tensor:
    """The same values in a non-contiguous layout: every other row, or every other column."""
    if t.dim() < 2 or how == "contiguous":
        return t
    if how == "rows":
        big = torch.empty((t.shape[0] * 2, *t.shape[1:]), dtype=t.dtype, device=t.device)
        view = big[::2]
    else:
        big = torch.empty((*t.shape[:-1], t.shape[-1] * 2), dtype=t.dtype, device=t.device)
        view = big[..., ::2]
    with torch.no_grad():
        view.copy_(t)
    return view


def draw_dtype(data: st.DataObject) -> torch.dtype:
    return data.draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), label="dtype")


def check_case(op: str, impl: str, case: Case, dtype: torch.dtype, grad: bool) -> None:
    """One drawn case against the float64 reference (skipped where the impl's predicate refuses it)."""
    if refusal(op, impl, case) is not None:
        return
    (result,) = check_parity(op, [impl], device="cpu", dtypes=[dtype], cases=[case], backward=grad)
    assert result.ok, str(result)
