"""explain never lies: for a call, ``explain`` with the same arguments under the same settings
names the impl (and the source) that the real call then records in ``decisions()``, and explain
itself changes nothing (no decision recorded or memoized, no random draw, no tensor written).

The findings each have a test of their own; :func:`test_explain_names_what_the_call_runs` checks
every op on its first parity case under the variants that change a decision (grad, grad modes,
layout, dtype, the settings of the resolution order, determinism, autocast, forward AD)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import polykernel
from polykernel.core import registry
from polykernel.core.selection import _record
from polykernel.errors import OpArgumentError

Call = tuple[tuple[Any, ...], dict[str, Any]]


def _tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    return [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]


def _outcome(fn: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return "ok", fn()
    except Exception as exc:
        return "raise", type(exc)


def explained_and_ran(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """``explain``'s (chosen, source) and the real call's (impl, source) from ``decisions()``, each
    an exception type where it raised (explain may instead leave no impl chosen: ``None``); and
    asserts that explain left the dispatcher, the random stream and the tensors as they were."""
    op = registry.get_op(name)
    tensors = _tensors(args, kwargs)
    counted = [t for t in tensors if not t.is_inference()]  # (inference tensors have no version)
    versions, values = [t._version for t in counted], [t.detach().clone() for t in tensors]
    record, memo, rng = list(_record.items()), dict(op._memo), torch.get_rng_state()
    explained = _outcome(lambda: polykernel.explain(name, *args, **kwargs))
    assert list(_record.items()) == record and dict(op._memo) == memo, "explain recorded or memoized a decision"
    assert torch.equal(torch.get_rng_state(), rng), "explain drew from the random stream"
    assert [t._version for t in counted] == versions, "explain bumped a tensor's version"
    assert all(torch.equal(a.detach(), b) or torch.equal(a.detach().isnan(), b.isnan()) for a, b in zip(tensors, values))
    ran = _outcome(lambda: getattr(polykernel, name)(*args, **kwargs))
    if explained[0] == "ok":
        e = explained[1]
        explained = (e.chosen, e.source) if e.chosen is not None else None
    else:
        explained = explained[1]
    if ran[0] == "raise":
        return explained, ran[1]
    d = polykernel.decisions(name)[-1]
    return explained, (d["impl"], d["source"])


def assert_truthful(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    explained, ran = explained_and_ran(name, args, kwargs)
    if isinstance(ran, type):  # the call raised: explain raises the same error, or chooses nothing
        assert explained is None or explained is ran, f"{name}: explain says {explained}, the call raised {ran.__name__}"
    else:
        assert explained == ran, f"{name}: explain says {explained}, the call ran {ran}"


def _inference(t: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return t.clone()


# -- findings --------------------------------------------------------------------------------


def test_a_call_that_saves_an_inference_tensor_is_explained_as_decided():
    """A call whose autograd must save an inference tensor (the input requires grad, the target
    was made under inference_mode) is decided under its own key, where only the torch impl is
    eligible: explain used to name the auto choice (triton) for it."""
    x = torch.randn(4, 8).log_softmax(-1).requires_grad_()
    target = _inference(torch.randn(4, 8).softmax(-1))
    explained, ran = explained_and_ran("kl_div", (x, target), {})
    assert explained == ran == ("torch", "auto")
    e = polykernel.explain("kl_div", x, target)
    assert "inference tensor" in {r["name"]: r["reason"] for r in e.impls}["triton"]


@pytest.mark.parametrize("how", ["inference tensor", "requires grad"])
def test_a_destination_the_call_refuses_to_write_is_refused_by_explain(how):
    """The ops that write their arguments refuse, before deciding, what torch's in-place ops
    refuse (an inference tensor outside inference_mode, a tensor that requires grad under grad
    mode): explain used to name an impl for the first (the call raises), and to raise the op's
    validation error, not the call's, for the second."""
    x, residual, w = torch.randn(3, 8), torch.randn(3, 8), torch.ones(8)
    x = _inference(x) if how == "inference tensor" else x.requires_grad_()
    with pytest.raises(OpArgumentError) as call:
        polykernel.fused_add_rms_norm_(x, residual, w)
    with pytest.raises(OpArgumentError) as explained:
        polykernel.explain("fused_add_rms_norm_", x, residual, w)
    assert str(explained.value) == str(call.value)
    if how == "requires grad":
        with torch.no_grad():  # the same tensor under no_grad: written, and explained so
            assert_truthful("fused_add_rms_norm_", (x, residual, w), {})


def _memoized_decision(name: str) -> Any:
    (decision,) = registry.get_op(name)._memo.values()
    return decision


def test_after_a_runtime_fault_explain_names_the_fallback_the_calls_run():
    """After the chosen impl faulted, the calls run the memoized fallback decision: explain used
    to resolve afresh and call it an auto choice."""
    x, w = torch.randn(3, 8), torch.ones(8)
    polykernel.rms_norm(x, w)
    first = _memoized_decision("rms_norm")

    def fault(*args):
        raise RuntimeError("planted fault")

    first.fn = fault
    with pytest.warns(RuntimeWarning, match="failed at run time"):
        polykernel.rms_norm(x, w)
    assert polykernel.decisions("rms_norm")[-1]["source"] == "fallback"
    explained, ran = explained_and_ran("rms_norm", (x, w), {})
    assert explained == ran and ran[1] == "fallback" and ran[0] != first.impl


def test_an_env_variable_set_after_the_decision_is_explained_as_the_call_ignores_it(monkeypatch):
    """Env variables are read when a key is first decided: a call after one changed (without
    clear_caches) runs the memoized decision, which explain names, not the env's impl."""
    x, w = torch.randn(3, 8), torch.ones(8)
    polykernel.rms_norm(x, w)
    chosen = polykernel.decisions("rms_norm")[-1]["impl"]
    other = next(n for n in polykernel.available_impls("rms_norm") if n != chosen)
    monkeypatch.setenv("POLYKERNEL_IMPL_RMS_NORM", other)
    explained, ran = explained_and_ran("rms_norm", (x, w), {})
    assert explained == ran == (chosen, "auto")
    polykernel.clear_caches()  # decided afresh: the env's impl, explained so
    explained, ran = explained_and_ran("rms_norm", (x, w), {})
    assert explained == ran == (other, "env")
