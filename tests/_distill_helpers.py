"""Helpers shared by the distillation losses' tests (kl_div, jsd, tvd, fused_linear_jsd): the
property test and the bad-input check they all run, hypothesis settings and layouts (those of
tests/_property.py), the Liger adapters called directly (the dispatcher runs Liger on CUDA
only), and the GPU parity split (a peer only on the cases its predicate and its documented
divergences allow)."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from _property import layout as _layout
from _property import property_settings
from polykernel.core import registry
from polykernel.testing import assert_parity, check_parity, exact, fresh, refusal, runnable_impls

DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# The interpreter's numpy warns on log(0), 0·inf and inf - inf that the kernels mask or expect.
INTERPRETER_WARNINGS = [
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
]


def need(op: str, impl: str, dtype: torch.dtype = torch.float32) -> None:
    if impl not in runnable_impls(op, "cpu", dtype):
        pytest.skip(f"{impl} not runnable on the CPU here")


def cpu_parity(op_name: str, impl: str, dtype: torch.dtype) -> None:
    """The op's CPU cases (its ``cases``) of ``impl`` in ``dtype`` against the reference (skipped
    where ``impl`` cannot run on the CPU)."""
    need(op_name, impl, dtype)
    assert_parity(op_name, [impl], device="cpu", dtypes=[dtype])


@st.composite
def rows_shape(draw: Callable) -> tuple[tuple[int, ...], int, str]:
    """A ``[..., V]`` loss's drawn leading shape (empty, one row, 2-d among them), its V (1 to past
    one block) and a layout for :func:`layout`."""
    lead = draw(st.sampled_from([(3,), (0,), (1,), (2, 3), (7,)]))
    v = draw(st.sampled_from([1, 2, 7, 33, 127, 4099]))
    return lead, v, draw(st.sampled_from(["contiguous", "rows", "cols"]))


def parity_property(op_name: str, impl: str, cases: Callable[[torch.dtype], st.SearchStrategy], n: int) -> None:
    """Hypothesis: ``n`` drawn calls (a dtype of DTYPES, then a case of ``cases(dtype)``) of
    ``impl`` against the op's reference (skipped where ``impl`` cannot run on the CPU)."""
    need(op_name, impl)

    @property_settings(n)
    @given(st.data())
    def run(data):
        dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
        case = data.draw(cases(dtype), label="case")
        (result,) = check_parity(op_name, [impl], dtypes=[dtype], cases=[case])
        assert result.ok, str(result)

    run()


def raises_naming(fn: Callable, op_id: str, args: tuple, kwargs: dict, exc: type[Exception], words: str) -> None:
    """``fn(*args, **kwargs)`` raises ``exc``, its message naming the op and ``words`` (the argument)."""
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    assert op_id in str(info.value) and words in str(info.value)


def layout(t: torch.Tensor, how: str) -> torch.Tensor:
    """tests/_property.py's layout (every other row or column), ``t``'s requires_grad kept."""
    out = _layout(t, how)
    return out if out is t else out.requires_grad_(t.requires_grad)


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
    from _gpu_gates import fewer_rows

    # float64 references of at most 1 GiB per [N, V]; V is the first argument's last dim, or the
    # student weight's rows for fused_linear_jsd (its first argument is the [N, H] hidden)
    vocab = (lambda c: c.args[1].shape[0]) if op_name.startswith("fused_linear") else (lambda c: c.args[0].shape[-1])
    large = fewer_rows(op.cases("cuda", dtype, large=True), vocab)
    assert_parity(op_name, ours, device="cuda", dtypes=[dtype], cases=large)
    for peer in (n for n in names if n not in ours):
        cases = [c for c in large if refusal(op, peer, c) is None and not any(s in c.label for s in peer_skips)]
        assert_parity(op_name, [peer], device="cuda", dtypes=[dtype], cases=cases)
