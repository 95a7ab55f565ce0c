"""Options are checked by type and value on every call, and a bad argument never marks an impl
broken (issue 27).

The guarded ops validate once per argument class; a repeat of a class is recognised by its
guard and its options. Options used to be compared with ``==`` there and in the memo, under
which ``False == 0.0`` and ``tensor(1e-6) == 1e-6`` is truthy: after one valid call such options
got through, a tensor ``eps`` reached the Triton kernel, and its failure marked Triton broken.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import polykernel
from polykernel.core import registry, selection
from polykernel.errors import OpArgumentError

# (op, valid arguments, bad keyword options that a fresh call rejects)
CASES = [
    (
        "rms_norm",
        lambda: (torch.randn(3, 8), torch.ones(8)),
        [{"eps": True}, {"offset": False}, {"eps": torch.tensor(1e-6)}, {"offset": torch.tensor(1.0)}, {"casting": 1}],
    ),
    ("layer_norm", lambda: (torch.randn(3, 8), torch.ones(8), torch.zeros(8)), [{"eps": True}, {"eps": torch.tensor(1e-5)}]),
    ("fused_add_rms_norm", lambda: (torch.randn(3, 8), torch.randn(3, 8), torch.ones(8)), [{"offset": False}, {"eps": torch.tensor(1e-6)}]),
]


def _ids(cases):
    return [f"{op}-{'-'.join(map(str, kw))}-{type(next(iter(kw.values()))).__name__}" for op, _, kws in cases for kw in kws]


@pytest.mark.parametrize(("op", "make", "bad"), [(op, make, kw) for op, make, kws in CASES for kw in kws], ids=_ids(CASES))
def test_a_bad_option_after_a_valid_call_is_rejected_as_on_a_fresh_call(op, make, bad):
    fn = getattr(polykernel, op)
    polykernel.clear_caches()
    with pytest.raises(OpArgumentError) as fresh:
        fn(*make(), **bad)
    polykernel.clear_caches()
    fn(*make())  # a valid call: its class and options are memoized, and its guard installed
    fn(*make())
    with pytest.raises(OpArgumentError) as repeat:
        fn(*make(), **bad)
    assert repeat.value.arg == fresh.value.arg


def test_an_int_option_still_counts_as_its_float():
    x, w = torch.randn(3, 8), torch.ones(8)
    torch.testing.assert_close(polykernel.rms_norm(x, w, eps=1), polykernel.rms_norm(x, w, eps=1.0))


def _runnable(op, *args):
    return {r["name"]: r["runnable"] for r in polykernel.explain(op, *args).impls}


@pytest.mark.parametrize("dual_level", [False, True], ids=["plain", "forward-ad-level-open"])
def test_an_inference_tensor_that_autograd_must_save_runs_the_torch_impl(dual_level):
    """An inference tensor with a weight that needs a gradient: an autograd.Function cannot save
    it (torch refuses), torch's own ops can. Such a call is decided under its own key, where only
    the torch impl is eligible: no impl fails, nothing is marked broken, and plain calls of the
    same class keep their impl, before and after. The same with a forward-AD dual level open
    (calls without a tangent take the usual path: Op.forward_ad)."""
    import contextlib

    import torch.autograd.forward_ad as fwad

    with fwad.dual_level() if dual_level else contextlib.nullcontext():
        _inference_tensor_runs_the_torch_impl()


def _inference_tensor_runs_the_torch_impl():
    with torch.inference_mode():
        xi = torch.randn(3, 16)
    w = torch.ones(16, requires_grad=True)
    x = torch.randn(3, 16)
    first = polykernel.available_impls("rms_norm", device="cpu")[0]
    for a in (x, xi, x, xi):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no runtime-fault fallback
            y = polykernel.rms_norm(a, w)
        torch.testing.assert_close(y, polykernel.rms_norm(a, w, impl="torch"))
    ran = {(d["impl"], d.get("subclass")) for d in polykernel.decisions("rms_norm")}
    assert (first, None) in ran and ("torch", selection.INFERENCE) in ran
    assert _runnable("rms_norm", x, w)[first]


def _cpu_impl(backend, rank, fn):
    polykernel.register_impl(op="rms_norm", backend=backend, rank=rank, capabilities=frozenset({polykernel.CapabilityRequirement.CPU}))(fn)


def test_arguments_that_fail_every_impl_mark_nothing_broken(polykernel_reset):
    """The first impl raises and so does the next on the same arguments: the arguments are the
    cause. The first error is raised, with a note, and no impl is marked broken."""

    def first(x, weight, eps, offset, casting):
        raise RuntimeError("first: cannot take these values")

    def also(x, weight, eps, offset, casting):
        raise RuntimeError("torch: cannot take these values either")

    for name in polykernel.available_impls("rms_norm", device="cpu"):  # only the two below stay
        registry.unregister_impl("rms_norm", name)
    _cpu_impl("cuda_jit", 1, first)
    _cpu_impl("torch", 100, also)
    x, w = torch.randn(3, 8), torch.ones(8)
    with pytest.raises(RuntimeError, match="first: cannot take") as info:
        polykernel.rms_norm(x, w)
    assert not any(selection._broken.values())  # the fault table itself: nothing recorded
    assert _runnable("rms_norm", x, w)["cuda_jit"]
    if hasattr(info.value, "__notes__"):
        assert "nothing was marked broken" in " ".join(info.value.__notes__)


def test_a_real_fault_still_falls_back_and_marks_the_impl(polykernel_reset):
    calls = []

    def broken(x, weight, eps, offset, casting):
        calls.append("broken")
        raise RuntimeError("kernel failed to compile")

    polykernel.register_impl(op="rms_norm", backend="cuda_jit", rank=1, capabilities=frozenset({polykernel.CapabilityRequirement.CPU}))(
        broken
    )
    x, w = torch.randn(3, 8), torch.ones(8)
    with pytest.warns(RuntimeWarning, match="failed at run time"):
        y = polykernel.rms_norm(x, w)
    torch.testing.assert_close(y, polykernel.rms_norm(x, w, impl="torch"))
    assert calls == ["broken"]
    assert not _runnable("rms_norm", x, w)["cuda_jit"]
