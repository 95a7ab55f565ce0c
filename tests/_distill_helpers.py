"""Helpers shared by the distillation losses' tests (kl_div, jsd, tvd, fused_linear_jsd):
hypothesis settings as in tests/reliability/test_reliability_parity.py, layouts, the Liger
adapters called directly (the dispatcher runs Liger on CUDA only), and the GPU parity split
(a peer only on the cases its predicate and its documented divergences allow)."""

from __future__ import annotations

import inspect
import os

import pytest
import torch
from hypothesis import HealthCheck, settings

from polykernel.core import registry
from polykernel.testing import assert_parity, exact, fresh, refusal, runnable_impls

DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# The interpreter's numpy warns on log(0), 0·inf and inf - inf that the kernels mask or expect.
INTERPRETER_WARNINGS = [
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
]


def examples(default: int) -> int:
    raw = os.environ.get("POLYKERNEL_HYPOTHESIS_EXAMPLES", "").strip()
    return int(raw) if raw.isdigit() and int(raw) > 0 else default


def property_settings(n: int) -> settings:
    return settings(
        max_examples=examples(n),
        derandomize=True,  # the same examples on every run
        database=None,
        deadline=None,  # the interpreter's first compile of a kernel is slow
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        print_blob=True,
    )


def need(op: str, impl: str, dtype: torch.dtype = torch.float32) -> None:
    if impl not in runnable_impls(op, "cpu", dtype):
        pytest.skip(f"{impl} not runnable on the CPU here")


def layout(t: torch.Tensor, how: str) -> torch.Tensor:
    """The same values in another layout: every other row or every other column."""
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
    return view.requires_grad_(t.requires_grad)


def liger_matches_reference(op_name: str, case, *, atol: float = 1e-5, rtol: float = 1e-4) -> None:
    """Call the op's Liger adapter directly on ``case`` (fp32) and compare loss and gradients with
    the float64 reference (fp32 tolerances, as tests/backends/test_peers.py does)."""
    op = registry.get_op(op_name)
    impl = registry.specs_for(op)["liger"].load()
    bound = inspect.signature(op.reference).bind(*case.args, **case.kwargs)
    bound.apply_defaults()
    args = tuple(bound.arguments.values())
    mine, ref_args = [fresh(a) for a in args], [exact(a) for a in args]
    out = impl(*mine)
    ref = op.reference(*ref_args)
    assert out.dtype == torch.float32 and out.shape == ref.shape, case.label
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol, equal_nan=True, msg=case.label)
    leaves = [i for i, a in enumerate(mine) if isinstance(a, torch.Tensor) and a.requires_grad]
    if not out.requires_grad or not leaves:
        return
    cot = 2 * torch.rand_like(out) - 1
    got = torch.autograd.grad(out, [mine[i] for i in leaves], cot, allow_unused=True)
    want = torch.autograd.grad(ref, [ref_args[i] for i in leaves], cot.double(), allow_unused=True)
    for i, g, w in zip(leaves, got, want):
        if w is None:
            continue
        assert g is not None, f"{case.label}: no gradient for argument {i}"
        torch.testing.assert_close(g.double(), w, atol=atol / 10, rtol=rtol, equal_nan=True, msg=f"{case.label} grad {i}")


def gpu_parity(op_name: str, dtype: torch.dtype, peer_skips: tuple[str, ...] = ()) -> None:
    """Every runnable impl on the op's large cases; a peer on those its predicate takes and whose
    labels hold none of ``peer_skips`` (its documented divergences)."""
    op = registry.get_op(op_name)
    names = runnable_impls(op_name, "cuda", dtype)
    ours = [n for n in names if n in ("torch", "triton")]
    assert_parity(op_name, ours, device="cuda", dtypes=[dtype], large=True)
    for peer in (n for n in names if n not in ours):
        cases = [
            c for c in op.cases("cuda", dtype, large=True) if refusal(op, peer, c) is None and not any(s in c.label for s in peer_skips)
        ]
        assert_parity(op_name, [peer], device="cuda", dtypes=[dtype], cases=cases)
