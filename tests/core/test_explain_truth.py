"""explain never lies: for a call, ``explain`` with the same arguments under the same settings
names the impl (and the source) that the real call then records in ``decisions()``, and explain
itself changes nothing (no decision recorded or memoized, no random draw, no tensor written).

The findings each have a test of their own; :func:`test_explain_names_what_the_call_runs` checks
every op on its first parity case under the variants that change a decision (grad, grad modes,
layout, dtype, the settings of the resolution order, determinism, autocast, forward AD)."""

from __future__ import annotations

import contextlib
import importlib
import warnings
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import pytest
import torch
import torch.autograd.forward_ad as fwad

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
    an exception type where it raised (explain may instead leave no impl chosen: ``None``; a call
    whose impl raised, torch refusing the arguments say, has its decision); and
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
    decided = polykernel.decisions(name)
    if not decided:  # the call raised before deciding (an impl that raised has its record)
        return explained, ran[1]
    return explained, (decided[-1]["impl"], decided[-1]["source"])


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


def _fault(*args: Any) -> Any:
    raise RuntimeError("planted fault")


def _memoized_decision(name: str) -> Any:
    (decision,) = registry.get_op(name)._memo.values()
    return decision


def test_after_a_runtime_fault_explain_names_the_fallback_the_calls_run():
    """After the chosen impl faulted, the calls run the memoized fallback decision: explain used
    to resolve afresh and call it an auto choice."""
    x, w = torch.randn(3, 8), torch.ones(8)
    polykernel.rms_norm(x, w)
    first = _memoized_decision("rms_norm")

    first.fn = _fault
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


# -- every op, under the variants that change a decision ----------------------------------------


def _detached(a: Any) -> Any:
    return a.detach() if isinstance(a, torch.Tensor) else a


def _strided(a: torch.Tensor) -> torch.Tensor:
    """``a``'s values in every other element of a larger buffer (not contiguous), grad as ``a``."""
    buf = torch.zeros(*a.shape, 2, dtype=a.dtype)
    buf[..., 0] = a.detach()
    return buf[..., 0].requires_grad_(a.requires_grad)


def _first(args: tuple[Any, ...], pick: Callable[[torch.Tensor], bool], change: Callable[[torch.Tensor], torch.Tensor]) -> tuple[Any, ...]:
    i = next((i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and pick(a)), None)
    return args if i is None else (*args[:i], change(args[i]), *args[i + 1 :])


@contextlib.contextmanager
def _set_impl(impl: str, op: str | None = None) -> Iterator[None]:
    polykernel.set_impl(impl, op=op)
    try:
        yield
    finally:
        polykernel.set_impl(None)


@contextlib.contextmanager
def _deterministic() -> Iterator[None]:
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


@contextlib.contextmanager
def _env(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> Iterator[None]:
    with monkeypatch.context() as m:
        m.setenv(name, value)
        yield


def _dual(a: torch.Tensor) -> torch.Tensor:
    return fwad.make_dual(a.detach(), torch.ones_like(a.detach()))


def variants(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Any, Any]]:
    """(label, (args, kwargs) or a function making them in the context, context) for each
    variant of one call."""
    op = registry.get_op(name)
    impls = polykernel.available_impls(name)
    other = next((n for n in impls if n not in ("torch", "torch_compile")), "torch")  # (no compile: seconds each)
    none = contextlib.nullcontext
    plain = (args, kwargs)
    yield "as given", plain, none()
    yield "detached", (tuple(map(_detached, args)), {k: _detached(v) for k, v in kwargs.items()}), none()
    yield "no_grad", plain, torch.no_grad()
    yield "inference_mode", plain, torch.inference_mode()
    yield "not contiguous", (_first(args, lambda a: a.is_floating_point() and a.numel() > 1, _strided), kwargs), none()
    yield "inference tensors", (_first(args, lambda a: not a.requires_grad, _inference), kwargs), none()
    yield "deterministic", plain, _deterministic()
    yield "autocast", plain, torch.autocast("cpu", dtype=torch.bfloat16)
    yield "dual level open", plain, fwad.dual_level()
    yield "a tangent", lambda: (_first(args, lambda a: a.is_floating_point(), _dual), kwargs), fwad.dual_level()
    yield "use_impl torch", plain, polykernel.use_impl("torch")
    yield f"use_impl {other} for the op", plain, polykernel.use_impl(other, op=name)
    yield "set_impl torch", plain, _set_impl("torch")
    yield f"set_impl {other} for the op", plain, _set_impl(other, op=name)
    yield "POLYKERNEL_IMPL", plain, _env(monkeypatch, "POLYKERNEL_IMPL", f"{other},torch")
    yield "POLYKERNEL_IMPL_<OP>", plain, _env(monkeypatch, f"POLYKERNEL_IMPL_{op.name.upper()}", "torch")
    yield "impl=", (args, {**kwargs, "impl": other}), none()
    yield "impl= list", (args, {**kwargs, "impl": f"{other},torch"}), none()


def _first_case(op: Any, dtype: torch.dtype) -> Call:
    case = op.cases("cpu", dtype)[0]
    return case.args, dict(case.kwargs)


OPS = sorted(registry.all_op_ids())


@pytest.mark.parametrize("op_id", OPS)
def test_explain_names_what_the_call_runs(op_id, monkeypatch):
    check_op(op_id, monkeypatch)


def check_op(op_id: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """explain against the call for the op's first case under every variant, each dtype the op
    declares, and after the chosen impl faulted (a failure names the variant)."""
    op = registry.get_op(op_id)
    base = torch.float32 if torch.float32 in op.dtypes else op.dtypes[0]
    args, kwargs = _first_case(op, base)
    for label, call, context in variants(op.name, args, kwargs, monkeypatch):
        polykernel.clear_caches()
        with context:
            try:
                assert_truthful(op.name, *(call() if callable(call) else call))
            except AssertionError as exc:
                raise AssertionError(f"{label}: {exc}") from None
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        if dtype in op.dtypes and dtype != base:
            polykernel.clear_caches()
            assert_truthful(op.name, *_first_case(op, dtype))
    # the impl chosen faults at run time: marked broken, the calls run the next one
    polykernel.clear_caches()
    getattr(polykernel, op.name)(*args, **kwargs)
    if polykernel.decisions(op.name)[-1]["impl"] == "torch":
        return  # (the last resort: its fault is raised)
    _memoized_decision(op.name).fn = _fault
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        getattr(polykernel, op.name)(*args, **kwargs)
    assert polykernel.decisions(op.name)[-1]["source"] == "fallback"
    assert_truthful(op.name, args, kwargs)


@pytest.mark.parametrize(
    ("rule", "caught"),
    [
        ("_scope", r"use_impl torch: rms_norm: explain says \(.triton., .auto.\)"),
        ("_memoized", "explain says .*'auto'.*the call ran .*'fallback'"),
    ],
)
def test_the_check_catches_an_explain_that_skips_a_rule(rule, caught, monkeypatch):
    """The check can fail: an explain that ignores the use_impl scopes, or the memo, is caught."""
    explain_module = importlib.import_module("polykernel.core.selection.explain")  # (the package's name is the function)
    skip = {"_scope": ContextVar("no scopes", default=()), "_memoized": lambda op, key: None}[rule]
    monkeypatch.setattr(explain_module, rule, skip)
    with pytest.raises(AssertionError, match=caught):
        check_op("norm.rms_norm", monkeypatch)


def test_a_tuned_decision_is_explained_as_the_call_takes_it(tmp_path, monkeypatch):
    """A decision the tuning store holds (measured once on planted impls, on a fake clock): explain
    and the call both take it from the store, for the measured size and for another bucket."""
    from _tuning_helpers import isolate_tuning, only, plant, use_fake_clock

    use_fake_clock(monkeypatch)
    isolate_tuning(tmp_path, monkeypatch)
    monkeypatch.setenv("POLYKERNEL_TUNE", "on")
    plant("cuda_jit", 1, delay=0.006)
    plant("cute_dsl", 2, delay=0.001)
    only("cuda_jit", "cute_dsl")
    x, w = torch.randn(4, 8), torch.ones(8)
    polykernel.rms_norm(x, w)  # measures and stores
    polykernel.clear_caches()
    explained, ran = explained_and_ran("rms_norm", (x, w), {})
    assert explained == ran == ("cute_dsl", "tuned")
    monkeypatch.setenv("POLYKERNEL_TUNE", "cached")
    polykernel.clear_caches()
    assert_truthful("rms_norm", (torch.randn(512, 8), w), {})  # another size bucket, not measured
