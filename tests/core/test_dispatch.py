"""The dispatcher contract: every rule of the resolution order, every error, memo and faults.

Throwaway impls of rms_norm are registered per test (the autouse fixture removes them again);
each records its calls, so a test sees which impl actually ran.
"""

import threading
import warnings

import pytest
import torch

import polykernel
from polykernel import _compat, tuning
from polykernel.core import memo_key, registry
from polykernel.core import selection as dispatch
from polykernel.core.selection import resolution
from polykernel.errors import ImplNotAvailableError, UnknownImplError, UnknownOpError
from polykernel.ops.rms_norm import reference
from polykernel.spec import CapabilityRequirement, FormatSignature, KernelSpec

CALLS: list[str] = []


@pytest.fixture(autouse=True)
def _calls(monkeypatch):
    # Keep the built-in Triton impl out of the way: "builtin" below means the torch impl.
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    polykernel.clear_caches()
    CALLS.clear()
    yield


def fake(backend, rank, *, cpu=True, fail=False, **fields):
    """Register a recording rms_norm impl on the CPU (or CUDA-only when cpu=False)."""
    caps = {CapabilityRequirement.CPU} if cpu else {CapabilityRequirement.CUDA}

    def impl(x, weight, eps, offset, casting):
        CALLS.append(backend)
        if fail:
            raise RuntimeError(f"{backend} kernel failed to compile")
        return reference(x, weight, eps, offset, casting)

    polykernel.register_impl(op="rms_norm", backend=backend, rank=rank, capabilities=frozenset(caps), **fields)(impl)
    return impl


def args(n=8, dtype=torch.float32):
    return torch.randn(3, n, dtype=dtype), torch.randn(n, dtype=dtype)


def run(**kw):
    x, w = args()
    out = polykernel.rms_norm(x, w, **kw)
    torch.testing.assert_close(out, reference(x, w))
    return CALLS[-1] if CALLS else "builtin"


# --- 6. auto ---------------------------------------------------------------------------------


def test_auto_picks_lowest_rank_runnable():
    fake("liger", 50)
    fake("quack", 5, cpu=False)  # better rank but CUDA-only: not runnable on CPU
    fake("cuda_jit", 30)
    assert run() == "cuda_jit"
    e = polykernel.explain("rms_norm", *args())
    assert e.chosen == "cuda_jit" and e.source == "auto"
    reasons = {r["name"]: r["reason"] for r in e.impls}
    assert reasons["quack"] == "needs a CUDA device" and reasons["liger"] is None


def test_torch_is_always_eligible():
    assert polykernel.available_impls("rms_norm", device="cpu", dtype=torch.float64) == ["torch"]


def test_dtype_excluded_with_reason():
    fake("liger", 1, format_signature=FormatSignature(supported_dtypes=("bfloat16",)))
    assert run() == "builtin"  # float32 -> liger excluded
    e = polykernel.explain("rms_norm", *args())
    assert {r["name"]: r["reason"] for r in e.impls}["liger"] == "dtype float32 not supported"
    with pytest.raises(ImplNotAvailableError, match="dtype float32 not supported"):
        run(impl="liger")


def test_predicate_on_argument_class():
    fake("liger", 1, predicate=lambda a: None if a.n is None or a.n <= 16 else f"N={a.n} > 16")
    x, w = args(8)
    polykernel.rms_norm(x, w)
    assert CALLS == ["liger"]
    x, w = args(32)
    polykernel.rms_norm(x, w)
    assert CALLS == ["liger"]  # N=32: liger refused, builtin ran
    assert "N=32 > 16" in str(polykernel.explain("rms_norm", x, w))


def test_no_backward_impl_excluded_when_grad_needed():
    fake("liger", 1, format_signature=FormatSignature(supports_backward=False))
    x, w = args()
    polykernel.rms_norm(x, w)
    assert CALLS == ["liger"]
    polykernel.rms_norm(x.requires_grad_(), w)
    assert CALLS == ["liger"]
    with torch.no_grad():
        polykernel.rms_norm(x, w)
    assert CALLS == ["liger", "liger"]


def test_deterministic_mode_excludes_nondeterministic_impls():
    fake("liger", 1, deterministic=False)
    assert run() == "liger"
    torch.use_deterministic_algorithms(True)
    try:
        CALLS.clear()
        assert run() == "builtin"
        reason = {r["name"]: r["reason"] for r in polykernel.explain("rms_norm", *args()).impls}["liger"]
        assert "deterministic" in reason
    finally:
        torch.use_deterministic_algorithms(False)
    assert run() == "liger"


# --- 1. impl= ----------------------------------------------------------------------------------


def test_impl_argument_wins_over_everything(monkeypatch):
    fake("liger", 1)
    fake("cuda_jit", 2)
    polykernel.set_impl("liger", op="rms_norm")
    monkeypatch.setenv("POLYKERNEL_IMPL_RMS_NORM", "liger")
    with polykernel.use_impl("liger", op="rms_norm"):
        assert run(impl="cuda_jit") == "cuda_jit"
    assert polykernel.explain("rms_norm", *args(), impl="cuda_jit").source == "argument"


def test_impl_argument_strict_errors():
    fake("quack", 1, cpu=False)
    with pytest.raises(ImplNotAvailableError) as info:
        run(impl="quack")
    err = info.value
    assert (err.op, err.impl, err.reason) == ("norm.rms_norm", "quack", "needs a CUDA device")
    assert "torch" in err.runnable and "would run here: " in str(err)
    with pytest.raises(ImplNotAvailableError, match="no 'cuda_jit' impl is registered"):  # a backend the op lacks
        polykernel.swiglu(torch.randn(2, 8), torch.randn(2, 8), impl="cuda_jit")
    for typo in ("cuda", "tritonn", "Torch"):  # not an impl of the op: the op's impls are listed
        with pytest.raises(ImplNotAvailableError, match=f"no '{typo}' impl is registered for this op; its impls are: ") as info:
            run(impl=typo)
        assert isinstance(info.value, UnknownImplError) and isinstance(info.value, ValueError)
        assert {"torch", "triton", "quack"} <= set(info.value.valid)
        assert "rms_norm(impl=)" in str(info.value)


@pytest.mark.parametrize("bad", ["", " ", ",,,", "x" * 100_000, "triton,tritonn", 123, 1.5, ("triton", 5), ["torch", None]])
def test_hostile_impl_values_are_clear_errors(bad):
    with pytest.raises(UnknownImplError) as info:
        run(impl=bad)
    text = str(info.value)
    assert text.startswith("norm.rms_norm: impl ") and "its impls are: " in text and len(text) < 600


@pytest.mark.parametrize("bad", ["tritonn", ",,,", "x" * 100_000, "cuda_jit"])
def test_scoped_and_set_impl_for_an_op_list_the_valid_names(bad):
    # swiglu: an op without a cuda_jit impl (rms_norm has every backend)
    with pytest.raises(UnknownImplError, match="its impls are: ") as info:
        with polykernel.use_impl(bad, op="swiglu"):
            pass
    assert len(str(info.value)) < 600 and "use_impl" in str(info.value)
    with pytest.raises(UnknownImplError, match="its impls are: ") as info:
        polykernel.set_impl(bad, op="swiglu")
    assert len(str(info.value)) < 600 and "set_impl" in str(info.value)
    assert dispatch.get_impl_settings() == {}


@pytest.mark.parametrize("bad", ["tritonn", ",,,", "x" * 100_000])
def test_env_per_op_unknown_impl_lists_the_valid_names(monkeypatch, bad):
    monkeypatch.setenv("POLYKERNEL_IMPL_RMS_NORM", bad)
    polykernel.clear_caches()
    with pytest.raises(UnknownImplError, match=r"POLYKERNEL_IMPL_RMS_NORM: no .* impl is registered for this op; its impls are: ") as info:
        run()
    assert len(str(info.value)) < 600


@pytest.mark.parametrize("bad", ["fastest", ",,,", "x" * 100_000, "triton,,fast"])
def test_global_names_not_a_backend_are_errors_naming_the_variable(monkeypatch, bad):
    with pytest.raises(ValueError, match=r"set_impl: .* is not an impl name") as info:
        polykernel.set_impl(bad)
    assert len(str(info.value)) < 600
    with pytest.raises(ValueError, match=r"use_impl: .* is not an impl name"):
        with polykernel.use_impl(bad):
            pass
    monkeypatch.setenv("POLYKERNEL_IMPL", bad)
    polykernel.clear_caches()
    with pytest.raises(ValueError, match=r"POLYKERNEL_IMPL: .* is not an impl name") as info:
        run()
    assert len(str(info.value)) < 600
    with pytest.raises(ValueError, match="not an impl name"):
        polykernel.set_impl(12)


def test_missing_module_reason():
    polykernel.register_impl(
        KernelSpec("norm.rms_norm", "cute_dsl", "polykernel_no_such:f", requires_modules=("polykernel_no_such_pkg",), rank=1)
    )
    with pytest.raises(ImplNotAvailableError, match="module 'polykernel_no_such_pkg' not installed"):
        run(impl="cute_dsl")
    assert run() == "builtin"


def test_import_failure_of_target_is_a_reason_not_a_crash():
    polykernel.register_impl(KernelSpec("norm.rms_norm", "cutile", "polykernel_no_such_module:f", rank=1))
    assert run() == "builtin"
    reason = {r["name"]: r["reason"] for r in polykernel.explain("rms_norm", *args()).impls}["cutile"]
    assert reason.startswith("import failed: ModuleNotFoundError")


# --- 2. use_impl scopes -------------------------------------------------------------------------


def test_scope_for_op_is_strict_and_nested_innermost_wins():
    fake("liger", 50)
    fake("cuda_jit", 60)
    with polykernel.use_impl("liger", op="rms_norm"):
        assert run() == "liger"
        with polykernel.use_impl("cuda_jit", op="norm.rms_norm"):
            assert run() == "cuda_jit"
            assert polykernel.explain("rms_norm", *args()).source == "scope"
        assert run() == "liger"
    assert polykernel.explain("rms_norm", *args()).source == "auto"


def test_scope_for_op_unknown_impl_raises_at_entry():
    for name in ("cuda_jit", "tritonn"):  # an impl the op lacks (swiglu has no cuda_jit), a typo
        with pytest.raises(ImplNotAvailableError, match="its impls are: "):
            with polykernel.use_impl(name, op="swiglu"):
                pass


def test_scope_without_op_is_a_preference_that_skips(caplog):
    fake("liger", 50)
    with polykernel.use_impl("cute_dsl,liger"):
        assert run() == "liger"
    with polykernel.use_impl("cute_dsl"):
        with caplog.at_level("WARNING", logger="polykernel"):
            assert polykernel.explain("rms_norm", *args()).source == "auto"
            run()
        assert "scope preference cute_dsl skipped" in caplog.text


def test_skipped_preference_is_logged_once_per_reason_not_per_argument_class(caplog):
    """A preference for an impl that cannot run here (not installed, no GPU) says so once per op,
    however many argument classes (dtypes, sizes) the op then meets."""
    with polykernel.use_impl("cute_dsl"), caplog.at_level("WARNING", logger="polykernel"):
        for dtype in (torch.float32, torch.float64, torch.bfloat16):
            x, w = args(dtype=dtype)
            polykernel.rms_norm(x, w)
    assert caplog.text.count("scope preference cute_dsl skipped") == 1


def test_scope_is_per_thread():
    fake("liger", 50)
    seen = []
    with polykernel.use_impl("liger", op="rms_norm"):
        t = threading.Thread(target=lambda: seen.append(polykernel.explain("rms_norm", *args()).source))
        t.start()
        t.join()
        assert polykernel.explain("rms_norm", *args()).source == "scope"
    assert seen == ["auto"]


# --- 3. environment -------------------------------------------------------------------------------


def test_env_per_op_is_strict(monkeypatch):
    fake("liger", 50)
    monkeypatch.setenv("POLYKERNEL_IMPL_RMS_NORM", "liger")
    polykernel.clear_caches()
    assert run() == "liger"
    assert polykernel.explain("rms_norm", *args()).source == "env"
    monkeypatch.setenv("POLYKERNEL_IMPL_RMS_NORM", "quack")
    polykernel.clear_caches()
    with pytest.raises(ImplNotAvailableError):
        run()


def test_env_global_preference_list(monkeypatch):
    fake("liger", 50)
    fake("cuda_jit", 60)
    monkeypatch.setenv("POLYKERNEL_IMPL", "quack,cuda_jit,liger")
    polykernel.clear_caches()
    assert run() == "cuda_jit"


def test_env_global_skips_ops_without_it(monkeypatch):
    monkeypatch.setenv("POLYKERNEL_IMPL", "liger")
    polykernel.clear_caches()
    assert run() == "builtin"


def test_env_beats_set_impl_and_scope_beats_env(monkeypatch):
    fake("liger", 50)
    fake("cuda_jit", 60)
    polykernel.set_impl("cuda_jit", op="rms_norm")
    monkeypatch.setenv("POLYKERNEL_IMPL_RMS_NORM", "liger")
    polykernel.clear_caches()
    assert run() == "liger"
    with polykernel.use_impl("cuda_jit", op="rms_norm"):
        assert run() == "cuda_jit"


def test_env_name_not_a_backend_is_an_error(monkeypatch):
    monkeypatch.setenv("POLYKERNEL_IMPL", "fastest")
    polykernel.clear_caches()
    with pytest.raises(ValueError, match="POLYKERNEL_IMPL: 'fastest' is not an impl name"):
        run()


def test_strict_env_turns_skip_into_error(monkeypatch):
    monkeypatch.setenv("POLYKERNEL_IMPL", "liger")
    monkeypatch.setenv("POLYKERNEL_STRICT", "1")
    polykernel.clear_caches()
    with pytest.raises(ImplNotAvailableError, match="preference"):
        run()


# --- 4. set_impl ------------------------------------------------------------------------------------


def test_set_impl_global_preference_and_reset():
    fake("liger", 50)
    fake("cuda_jit", 60)
    polykernel.set_impl("cuda_jit")
    assert run() == "cuda_jit"
    assert polykernel.explain("rms_norm", *args()).source == "global"
    polykernel.set_impl(None)
    assert run() == "liger"


def test_set_impl_per_op_beats_global_and_resets_alone():
    fake("liger", 50)
    fake("cuda_jit", 60)
    polykernel.set_impl("liger")
    polykernel.set_impl("cuda_jit", op="rms_norm")
    assert run() == "cuda_jit"
    polykernel.set_impl(None, op="rms_norm")
    assert run() == "liger"


@pytest.mark.parametrize("hot", [False, True], ids=["memo", "guarded"])
def test_set_impl_while_another_thread_resolves_is_not_undone(monkeypatch, hot):
    # Another thread's set_impl lands while this call resolves (after it read the settings): the
    # decision it made runs for this call, and is then neither memoized nor kept by the guard.
    fake("liger", 50)
    real, fired = resolution._tuned, []

    def tuned(*a, **k):
        if not fired:
            fired.append(polykernel.set_impl("torch", op="rms_norm"))
        return real(*a, **k)

    monkeypatch.setattr(resolution, "_tuned", tuned)
    x, w = args()
    if hot:  # the guarded hot path (recent decisions by their guards)
        polykernel.rms_norm(x, w)
        polykernel.rms_norm(x, w)
    else:  # the memo (Op.call, as the compiled and DTensor paths take it)
        op = registry.get_op("rms_norm")
        argkey = op.key(x, w, 1e-6, 0.0, "fp32")
        op.call(None, argkey, x, w, 1e-6, 0.0, "fp32")
        op.call(None, argkey, x, w, 1e-6, 0.0, "fp32")
    assert CALLS == ["liger"]  # the second call: the torch impl, as set_impl says
    assert polykernel.explain("rms_norm", x, w).chosen == "torch"


@pytest.mark.parametrize("hot", [False, True], ids=["memo", "guarded"])
@pytest.mark.parametrize("changed", ["loss.cross_entropy", "norm.rms_norm"])
def test_a_change_while_resolving_makes_stale_only_that_ops_decisions(monkeypatch, hot, changed):
    # While rms_norm's call resolves, an op's impls change (as when an impl module registers its
    # op on its first import: backends/triton/kl_div.py imports ops/cross_entropy.py). Another
    # op's change leaves this decision memoized: its second call neither decides nor runs the
    # first-call check again (the H100, 2026-12-07: fused_linear_jsd's check ran on its first two
    # calls). A change to rms_norm's own impls still makes it stale.
    fake("liger", 50)
    real, resolved = resolution._tuned, []

    def tuned(*a, **k):
        if not resolved:
            registry.REGISTRY.changed(changed)
        resolved.append(1)
        return real(*a, **k)

    monkeypatch.setattr(resolution, "_tuned", tuned)
    checks = []
    real_checked = resolution.first_call.checked
    monkeypatch.setattr(resolution.first_call, "checked", lambda d: checks.append(d.impl) or real_checked(d))
    x, w = args()
    op = registry.get_op("rms_norm")
    for _ in range(3):
        if hot:
            polykernel.rms_norm(x, w)
        else:
            argkey = op.key(x, w, 1e-6, 0.0, "fp32")
            op.call(None, argkey, x, w, 1e-6, 0.0, "fp32")
    assert CALLS == ["liger"] * 3
    assert len(resolved) == len(checks) == (1 if changed != "norm.rms_norm" else 2)


def test_set_impl_validates_names():
    with pytest.raises(ValueError, match="not an impl name"):
        polykernel.set_impl("fast")
    with pytest.raises(ImplNotAvailableError):
        polykernel.set_impl("cuda_jit", op="swiglu")  # an impl swiglu lacks (rms_norm has every backend now)
    with pytest.raises(ImplNotAvailableError, match="its impls are: "):
        polykernel.set_impl("tritonn", op="rms_norm")
    with pytest.raises(UnknownOpError, match="known ops"):
        polykernel.set_impl("torch", op="rms_nrom")


def test_set_impl_global_skip_logged_once(caplog):
    with caplog.at_level("WARNING", logger="polykernel"):
        polykernel.set_impl("quack")
        run()
        run()
    assert caplog.text.count("skipped") == 1


# --- 5. tuned ---------------------------------------------------------------------------------------


def test_tuned_decision_between_global_and_auto(monkeypatch):
    fake("liger", 50)
    fake("cuda_jit", 60)
    x, w = args()
    argkey = registry.get_op("rms_norm").key(x, w)
    tuning.remember(registry.get_op("rms_norm"), argkey, "cuda_jit")
    assert run() == "cuda_jit"
    assert polykernel.explain("rms_norm", x, w).source == "tuned"
    polykernel.set_impl("liger")
    assert run() == "liger"  # step 4 beats step 5
    polykernel.set_impl(None)
    monkeypatch.setenv("POLYKERNEL_TUNE", "off")
    polykernel.clear_caches()
    tuning.remember(registry.get_op("rms_norm"), argkey, "cuda_jit")
    assert run() == "liger"


# --- 7. runtime faults ------------------------------------------------------------------------------


def test_runtime_fault_warns_once_marks_broken_and_falls_back():
    fake("liger", 1, fail=True)
    with pytest.warns(RuntimeWarning, match="liger.*failed at run time"):
        assert run() == "liger"  # it was tried first...
    assert CALLS == ["liger"]  # ...and the builtin torch impl produced the checked result
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run()  # no second warning, no second try for this key
    assert CALLS == ["liger"]
    e = polykernel.explain("rms_norm", *args())
    assert e.chosen == "torch"
    assert {r["name"]: r["reason"] for r in e.impls}["liger"].startswith("failed at run time")
    x, w = args(16)  # another argument class tries it again
    with pytest.warns(RuntimeWarning):
        polykernel.rms_norm(x, w)
    assert CALLS == ["liger", "liger"]


def test_runtime_fault_in_strict_mode_reraises(monkeypatch):
    fake("liger", 1, fail=True)
    monkeypatch.setenv("POLYKERNEL_STRICT", "1")
    with pytest.raises(RuntimeError, match="failed to compile"):
        run()


def test_runtime_fault_of_forced_impl_is_not_hidden():
    fake("liger", 100, fail=True)
    with pytest.raises(RuntimeError, match="failed to compile"):
        run(impl="liger")
    with polykernel.use_impl("liger", op="rms_norm"), pytest.raises(RuntimeError):
        run()


def test_runtime_fault_of_set_impl_falls_back():
    fake("liger", 100, fail=True)
    polykernel.set_impl("liger", op="rms_norm")
    with pytest.warns(RuntimeWarning):
        run()


def test_bad_input_errors_before_any_impl_runs():
    fake("liger", 1)
    with pytest.raises(ValueError):
        polykernel.rms_norm(torch.randn(3, 8), torch.randn(7))
    assert CALLS == []


# --- memo, explain, available_impls -----------------------------------------------------------------


def test_decisions_are_memoized(monkeypatch):
    fake("liger", 1)
    resolved = []
    real = resolution._resolve  # patched where it lives: decide and explain call it there
    monkeypatch.setattr(resolution, "_resolve", lambda op, key, *a, **k: resolved.append(key) or real(op, key, *a, **k))
    x, w = args()
    for _ in range(5):
        polykernel.rms_norm(x, w)
    assert len(resolved) == 1
    polykernel.rms_norm(*args(16))  # a new argument class: one more resolution
    assert len(resolved) == 2
    polykernel.clear_caches()
    polykernel.rms_norm(x, w)
    assert len(resolved) == 3


def test_selection_happens_before_autograd_records_the_node():
    # The chosen impl's own autograd graph is what backward runs through.
    seen = []

    def impl(x, weight, eps, offset, casting):
        seen.append("fwd")
        out = reference(x, weight, eps, offset, casting)
        out.register_hook(lambda g: seen.append("bwd") or g)
        return out

    polykernel.register_impl(op="rms_norm", backend="liger", rank=1, capabilities=frozenset({CapabilityRequirement.CPU}))(impl)
    x = torch.randn(3, 8, requires_grad=True)
    polykernel.rms_norm(x, torch.ones(8)).sum().backward()
    assert seen == ["fwd", "bwd"] and x.grad is not None


def test_available_impls_in_selection_order():
    fake("liger", 50)
    fake("cuda_jit", 60)
    fake("quack", 1, cpu=False)
    assert polykernel.available_impls("rms_norm", device="cpu")[:2] == ["liger", "cuda_jit"]
    assert "quack" not in polykernel.available_impls("norm.rms_norm", device="cpu")


def test_explain_lists_every_impl_and_serializes():
    import json

    fake("quack", 1, cpu=False)
    e = polykernel.explain("rms_norm", device="cpu", dtype=torch.bfloat16)
    text = str(e)
    for name in ("quack", "torch", "triton"):
        assert name in text
    assert "needs a CUDA device" in text and "source:" in text
    json.dumps(e.as_dict())


def test_unknown_op():
    with pytest.raises(UnknownOpError, match=r"known ops: .*rms_norm"):
        polykernel.explain("rmsnorm")


def test_a_misspelt_op_or_impl_name_suggests_the_closest():
    # as use_impl/set_impl and the POLYKERNEL_* names already do
    with pytest.raises(UnknownOpError, match=r"^unknown op 'rms_nrom' \(did you mean 'rms_norm'\?\); known ops: "):
        polykernel.explain("rms_nrom")
    with pytest.raises(UnknownOpError, match=r"\(did you mean 'rms_norm'\?\)"):
        polykernel.explain("norm.rms_nrom")
    with pytest.raises(UnknownImplError, match=r"its impls are: .*triton \(did you mean 'triton'\?\)"):
        polykernel.rms_norm(torch.randn(2, 8), torch.ones(8), impl="trion")
    with pytest.raises(UnknownOpError) as info:
        polykernel.explain("zzzz")  # nothing close: no suggestion
    assert "did you mean" not in str(info.value)


# --- registry ------------------------------------------------------------------------------------------


def test_declare_op_locations_is_lazy_and_idempotent():
    import builtins
    import sys

    sys.modules.pop("_pk_location_ok", None)
    before = getattr(builtins, "_pk_location_imports", 0)
    polykernel.declare_op_locations("rms_norm", "_pk_location_ok")
    assert "_pk_location_ok" not in sys.modules  # nothing imported yet
    threads = [threading.Thread(target=registry.specs_for, args=("rms_norm",)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert builtins._pk_location_imports == before + 1
    assert "quack" in polykernel.available_impls("rms_norm", device="cpu")
    polykernel.declare_op_locations("rms_norm", "_pk_location_ok")
    registry.specs_for("rms_norm")
    assert builtins._pk_location_imports == before + 1
    registry.undeclare_op_location("rms_norm", "_pk_location_ok")


# Thread B's first rms_norm call imports its op module and stops just before registering the op
# (which takes the registry's lock) until thread A, on its first softmax call, is importing a
# declared location of softmax that imports the rms_norm op module too.
_LOCATION_IMPORTS_AN_OP = """
import builtins
builtins._pk_a_in_location.set()
import polykernel.ops.rms_norm
"""
_TWO_FIRST_IMPORTS = """
import builtins, sys, threading
import torch, polykernel
from polykernel import backends
from polykernel.core import registry
sys.path.insert(0, sys.argv[1])
registry.get_op("softmax")
builtins._pk_a_in_location, b_registering = threading.Event(), threading.Event()
real = backends.declared
def declared(op_id):
    if op_id == "norm.rms_norm":
        b_registering.set()
        builtins._pk_a_in_location.wait(10)
    return real(op_id)
backends.declared = declared
polykernel.declare_op_locations("softmax", "_pk_location_imports_an_op")
b = threading.Thread(target=lambda: polykernel.rms_norm(torch.randn(2, 8), torch.ones(8)), daemon=True)
b.start()
b_registering.wait(10)
a = threading.Thread(target=lambda: polykernel.softmax(torch.randn(2, 8)), daemon=True)
a.start()
a.join(30)
b.join(30)
print("deadlock" if a.is_alive() or b.is_alive() else "done")
"""


def test_a_location_importing_an_op_module_that_another_thread_imports_does_not_deadlock(tmp_path):
    # (in a subprocess: a deadlock there leaves this process's registry usable)
    import subprocess
    import sys

    (tmp_path / "_pk_location_imports_an_op.py").write_text(_LOCATION_IMPORTS_AN_OP)
    out = subprocess.run([sys.executable, "-c", _TWO_FIRST_IMPORTS, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "done"


def test_failing_location_is_recorded_and_shown():
    polykernel.declare_op_locations("rms_norm", "_pk_location_broken")
    try:
        assert run() == "builtin"
        text = str(polykernel.explain("rms_norm", *args()))
        assert "_pk_location_broken failed to import" in text and "broken on purpose" in text
    finally:
        registry.undeclare_op_location("rms_norm", "_pk_location_broken")


def test_register_impl_decorator_needs_op_and_backend():
    with pytest.raises(TypeError):
        polykernel.register_impl(op="rms_norm")
    with pytest.raises(ValueError):
        polykernel.register_impl(op="rms_norm", backend="not_a_backend")


def test_triton_on_cpu_only_under_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    polykernel.clear_caches()
    reason = {r["name"]: r["reason"] for r in polykernel.explain("rms_norm", device="cpu").impls}["triton"]
    assert reason in ("needs a CUDA device", "module 'triton' not installed")


def test_decisions_lists_what_ran_and_why():
    fake("liger", 50)
    fake("quack", 1, cpu=False)
    run()
    (rec,) = polykernel.decisions("rms_norm")
    assert rec["impl"] == "liger" and rec["source"] == "auto" and rec["arg_class"]["n"] == 8
    assert ("quack", "needs a CUDA device") in rec["skipped"]
    polykernel.clear_caches()
    assert polykernel.decisions("rms_norm") == []


def test_decisions_survive_another_ops_registration():
    # Registering impls of one op drops only that op's memo; decisions() lists every op's.
    run()
    x = torch.randn(3, 8)
    polykernel.swiglu(x, x)
    polykernel.register_impl(op="swiglu", backend="cuda_jit", rank=200, capabilities=frozenset({CapabilityRequirement.CPU}))(
        lambda gate, up: gate
    )
    rms_norm, swiglu = registry.get_op("rms_norm"), registry.get_op("swiglu")
    assert rms_norm._memo and not swiglu._memo
    assert [d["op"] for d in polykernel.decisions()] == ["activation.swiglu", "norm.rms_norm"]
    polykernel.set_impl("torch")  # drops every memo; the record of what ran stays
    assert [d["op"] for d in polykernel.decisions()] == ["activation.swiglu", "norm.rms_norm"]
    run()
    assert [(d["op"], d["source"]) for d in polykernel.decisions()] == [("activation.swiglu", "auto"), ("norm.rms_norm", "global")]
    polykernel.clear_caches()
    assert polykernel.decisions() == []


def test_decisions_record_a_fallback():
    fake("liger", 1, fail=True)
    with pytest.warns(RuntimeWarning):
        run()
    (rec,) = polykernel.decisions("rms_norm")
    assert (rec["impl"], rec["source"]) == ("torch", "fallback")


def test_first_use_of_another_op_keeps_earlier_decisions():
    import subprocess
    import sys

    code = (
        "import torch, polykernel\n"
        "x = torch.randn(2, 8)\n"
        "polykernel.rms_norm(x, torch.ones(8))\n"
        "polykernel.swiglu(x, x)\n"
        "print(sorted(d['op'] for d in polykernel.decisions()))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['activation.swiglu', 'norm.rms_norm']"


def test_fault_in_the_last_runnable_impl_raises_the_original_error_and_does_not_stick(monkeypatch):
    # Only the torch impl can run (triton is off here): its failure is the user's error to see.
    import polykernel.backends.torch.rms_norm as torch_impl

    failures = iter([ValueError("bad data in this batch")])

    def flaky(x, weight, eps, offset, casting):
        for exc in failures:
            raise exc
        return reference(x, weight, eps, offset, casting)

    monkeypatch.setattr(torch_impl, "rms_norm", flaky)
    polykernel.clear_caches()
    with pytest.raises(ValueError, match="bad data in this batch"):
        run()
    assert run() == "builtin"  # the next call with the same argument class runs normally
    reasons = {r["name"]: r["reason"] for r in polykernel.explain("rms_norm", *args()).impls}
    assert reasons["torch"] is None


def test_capability_requirement_accepts_int_arch():
    from polykernel.spec import PlatformInfo

    req = CapabilityRequirement("cuda", 90, 100)
    assert req == CapabilityRequirement.cuda(min_sm=90, max_sm=100)
    assert req.is_satisfied_by(PlatformInfo("cuda", 0, (9, 0), "H200"))
    with pytest.raises(ValueError):
        CapabilityRequirement("gpu")


@pytest.mark.parametrize(
    "op_name",
    [
        "rms_norm",
        "fused_add_rms_norm",
        "layer_norm",
        "swiglu",
        "geglu",
        "softmax",
        "rope",
        "cross_entropy",
        "fused_linear_cross_entropy",
        "kl_div",
        "jsd",
        "tvd",
        "fused_linear_jsd",
    ],
)
def test_public_call_memo_key_is_the_ops_key(op_name):
    # several public functions build their argument class inline for speed (swiglu, geglu and
    # softmax pass it to Op.call): it must equal the op's key function, or a predicate reads the
    # wrong fields and explain() disagrees with the call
    op = registry.get_op(op_name)
    for case in op.cases("cpu", torch.float32)[:3]:
        polykernel.clear_caches()
        getattr(polykernel, op_name)(*case.args, **case.kwargs)
        assert len(op._memo) == 1, case.label
        (memo_key,) = op._memo
        assert memo_key[0] == op.key(*case.args, **case.kwargs), case.label


# -- the hot path's guard (Op.dispatch, polykernel.core.hit_guard) ----------------------------------
# A repeat of the last decision's argument class is recognised by a C check of the tensors'
# metadata instead of building the class. It must never let a call through whose class differs:
# each variant below changes one thing after two calls with the base arguments, and the call must
# then be decided under its own class (a new memo entry) or rejected by validation.


def _variants(op_name):
    """[(label, base args, args, context)] for a guarded op, args in the impl's order."""
    from contextlib import nullcontext

    def t(*shape, dtype=torch.float32, device="cpu", grad=False):
        return torch.randn(shape, dtype=dtype, device=device).requires_grad_(grad)

    def moved(args, i, **kw):
        out = list(args)
        x = out[i]
        if "device" in kw or "dtype" in kw:
            x = x.detach().to(device=kw.get("device", x.device), dtype=kw.get("dtype", x.dtype))
        if "grad" in kw and x.is_floating_point():  # (an int target takes no gradient)
            x = x.detach().clone().requires_grad_(kw["grad"])
        out[i] = x
        return tuple(out)

    # tensors that never take a gradient, like an int target: the losses' class weights (the op
    # refuses one that requires grad while grad mode is on, as F.cross_entropy does)
    no_grad = {"cross_entropy": {5}, "fused_linear_cross_entropy": {7}}.get(op_name, set())

    def everywhere(args, **kw):
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                args = moved(args, i, **({k: v for k, v in kw.items() if k != "grad"} if i in no_grad else kw))
        return args

    base = {
        "rms_norm": (t(4, 8), t(8), 1e-6, 0.0, "fp32"),
        "layer_norm": (t(4, 8), t(8), t(8), 1e-5),
        "fused_add_rms_norm": (t(4, 8), t(4, 8), t(8), 1e-6, 0.0),
        "swiglu": (t(4, 8), t(4, 8)),
        "geglu": (t(4, 8), t(4, 8), "tanh"),
        "softmax": (t(4, 8),),
        "rope": (t(2, 4, 3, 8), t(2, 2, 3, 8), t(1, 3, 8), t(1, 3, 8), 8, False),  # rotary_dim, interleaved
        "cross_entropy": (t(4, 8), torch.randint(0, 8, (4,)), -100, 0.0, "mean", t(8), 2.0, 0.0),
        "fused_linear_cross_entropy": (t(4, 8), t(10, 8), torch.randint(0, 10, (4,)), t(10), -100, 0.0, "mean", t(10), 2.0, 0.0),
        "moe_experts": (t(4, 8), torch.randint(0, 3, (4, 2)), t(4, 2), t(3, 12, 8), t(3, 8, 6), "silu"),
        "moe_router": (t(4, 8), 2, True),
        "kl_div": (t(4, 8), t(4, 8), "batchmean", False),
        "jsd": (t(4, 8), t(4, 8), torch.zeros(4, dtype=torch.long), 0.5, -100),
        "tvd": (t(4, 8), t(4, 8), torch.zeros(4, dtype=torch.long), "batchmean", -100),
        "fused_linear_jsd": (t(4, 8), t(10, 8), t(4, 6), t(10, 6), torch.zeros(4, dtype=torch.long), 0.5, -100, 1.0),
        "group_norm": (t(4, 8, 3), 2, t(8), t(8), 1e-5),
        "dyt": (t(4, 8), t(1), t(8), t(8)),
        "poly_norm": (t(4, 8), t(3), t(), 1e-6),
        "relu_squared": (t(4, 8),),
        "sparsemax": (t(4, 8), -1),
    }[op_name]
    spec = registry.get_op(op_name).guard
    tensors = [i for i, kind in enumerate(spec) if kind is not None]
    options = [i for i, kind in enumerate(spec) if kind is None]
    out = [
        ("same class again", base, nullcontext()),
        (
            "other leading dims",
            tuple(t(2, 3, 8) if spec[i] == "last" or isinstance(spec[i], int) else a for i, a in enumerate(base)),
            nullcontext(),
        ),
        ("all on meta", everywhere(base, device="meta"), nullcontext()),
        ("all bf16", everywhere(base, dtype=torch.bfloat16), nullcontext()),
        ("all float64", everywhere(base, dtype=torch.float64), nullcontext()),
        ("grad mode off", everywhere(base, grad=True), torch.no_grad()),
        ("inference mode", base, torch.inference_mode()),
        ("grad mode off, same tensors", everywhere(base, grad=True), torch.no_grad(), "own base"),
        ("inference mode, same tensors", everywhere(base, grad=True), torch.inference_mode(), "own base"),
        ("scope", base, polykernel.use_impl("torch")),
        ("deterministic", base, _deterministic_algorithms()),
        ("last dim 16", tuple(t(*a.shape[:-1], 16) if isinstance(a, torch.Tensor) else a for a in base), nullcontext()),
    ]
    if len(base) > 1:
        out += [
            ("a non-tensor", (base[0], [1.0] * 8, *base[2:]), nullcontext()),
            ("one tensor twice", (base[0], base[0][0] if spec[1] == "shape" else base[0], *base[2:]), nullcontext()),
        ]
    for i in tensors:
        out += [
            (f"arg {i} requires grad", moved(base, i, grad=True), nullcontext()),
            (f"arg {i} on meta", moved(base, i, device="meta"), nullcontext()),
            (f"arg {i} bf16", moved(base, i, dtype=torch.bfloat16), nullcontext()),
            (f"arg {i} int32", moved(base, i, dtype=torch.int32), nullcontext()),
            (f"arg {i} last dim 9", tuple(t(*a.shape[:-1], 9) if j == i else a for j, a in enumerate(base)), nullcontext()),
            (f"arg {i} one more dim", tuple(t(1, *a.shape) if j == i else a for j, a in enumerate(base)), nullcontext()),
            (f"arg {i} first dim 5", tuple(t(5, *a.shape[1:]) if j == i else a for j, a in enumerate(base)), nullcontext()),
            (f"arg {i} a subclass", tuple(a.as_subclass(_Sub) if j == i else a for j, a in enumerate(base)), nullcontext()),
        ]
        if i and spec[i] == "shape":
            out.append((f"arg {i} None", tuple(None if j == i else a for j, a in enumerate(base)), nullcontext()))
    for i in options:
        other = (
            (not base[i])
            if type(base[i]) is bool
            else {float: 1e-3, int: 7, str: "llama" if op_name == "rms_norm" else "none"}[type(base[i])]
        )
        out += [
            (f"option {i} changed", tuple(other if j == i else a for j, a in enumerate(base)), nullcontext()),
            (
                f"option {i} invalid",
                tuple(-1.0 if isinstance(a, float) else "bad" if j == i else a for j, a in enumerate(base)),
                nullcontext(),
            ),
        ]
    return [(v[0], v[1] if len(v) > 3 else base, *v[1:3]) for v in out]


class _Sub(torch.Tensor):
    pass


class _deterministic_algorithms:
    def __enter__(self):
        torch.use_deterministic_algorithms(True)

    def __exit__(self, *exc):
        torch.use_deterministic_algorithms(False)


GUARDED = [
    "rms_norm",
    "layer_norm",
    "fused_add_rms_norm",
    "swiglu",
    "geglu",
    "softmax",
    "rope",
    "cross_entropy",
    "fused_linear_cross_entropy",
    "moe_experts",
    "moe_router",
    "kl_div",
    "jsd",
    "tvd",
    "fused_linear_jsd",
    "group_norm",
    "dyt",
    "poly_norm",
    "relu_squared",
    "sparsemax",
]  # every op: one form
# Tests of the guarded path itself: without TensorGuards (POLYKERNEL_COMPAT_FALLBACKS=1, another
# torch) no decision is guarded; test_the_guard_is_optional covers that path.
needs_guard = pytest.mark.skipif(_compat.tensor_guards() is None, reason="no TensorGuards here: no guarded decisions")


@needs_guard
@pytest.mark.parametrize("op_name", GUARDED)
def test_the_guard_never_reuses_a_decision_for_another_class(op_name):
    from polykernel.errors import OpArgumentError

    op = registry.get_op(op_name)
    assert op.guard is not None
    for label, base, args, context in _variants(op_name):
        polykernel.clear_caches()
        op.dispatch(None, *base)
        op.dispatch(None, *base)
        assert op._fast, "the base call installed a guard"
        with context:
            scope, det = dispatch.SCOPE.get(), torch.are_deterministic_algorithms_enabled()
            try:
                expected = memo_key.key(op.key(*args), None, scope, det)
            except Exception:
                expected = None
            try:
                op.dispatch(None, *args)
            except (OpArgumentError, TypeError):
                with pytest.raises((OpArgumentError, TypeError)):  # validation rejects it as well
                    op.validate(*args)
                with pytest.raises((OpArgumentError, TypeError)):  # and so does a repeat
                    op.dispatch(None, *args)
                continue
            op.validate(*args)  # what ran without validating is valid: its class holds validity
        base_key = memo_key.key(op.key(*base), None, (), False)
        # (a subclass's call is decided under its class plus the subclass's name when it is new)
        assert {k._replace(subclass=None) for k in op._memo} == {base_key, expected}, label
        # and the base class is recognised again afterwards, by the decision made for it
        op.dispatch(None, *base)
        assert any(f[5] is op._memo[base_key] for f in op._fast), label


def test_the_guard_is_optional(monkeypatch):
    # Without torch's C guards (another torch, or the private API moved) every call builds its
    # argument class in Python: same decisions, same results, same errors. Both for an op built
    # while the guard was there and for one built without it (its dispatch skips the guard).
    from polykernel.core import hit_guard
    from polykernel.core import op as op_mod

    monkeypatch.setattr(hit_guard, "_tensor_guards", lambda: None)
    op = registry.get_op("rms_norm")
    x, w = torch.randn(3, 8), torch.randn(8)
    for dispatch_fn in (op.dispatch, op_mod._hot_dispatch(op)):
        polykernel.clear_caches()
        for _ in range(3):
            torch.testing.assert_close(dispatch_fn(None, x, w, 1e-6, 0.0, "fp32"), reference(x, w))
            torch.testing.assert_close(dispatch_fn(None, x, w), reference(x, w))  # the defaults
        assert not op._fast
        assert [k[0] for k in op._memo] == [op.key(x, w)]
        with pytest.raises(polykernel.errors.OpArgumentError, match="weight"):
            dispatch_fn(None, x, torch.randn(9), 1e-6, 0.0, "fp32")


@needs_guard
def test_a_fault_drops_the_guarded_decision():
    # A decision that faulted and was forgotten must not stay reachable through the guard.
    op = registry.get_op("rms_norm")
    x, w = torch.randn(3, 8), torch.randn(8)
    polykernel.rms_norm(x, w)
    polykernel.rms_norm(x, w)
    assert op._fast
    (key,) = op._memo
    op.forget(key)
    assert not op._fast
    polykernel.clear_caches()
    polykernel.rms_norm(x, w)
    polykernel.rms_norm(x, w)
    polykernel.clear_caches()
    assert not op._fast and not op._memo


def test_alternating_classes_each_run_their_own_decision():
    # More classes than the guarded records (FAST_RECORDS) taking turns, in grad mode and out of
    # it: every call runs the decision memoized for its own class.
    from polykernel.core import op as op_mod

    op = registry.get_op("rms_norm")
    calls = [(torch.randn(2, n), torch.randn(n), 1e-6, 0.0, "fp32") for n in (8, 16, 24, 32, 40, 48)]
    calls.append((torch.randn(2, 8, requires_grad=True), torch.randn(8), 1e-6, 0.0, "fp32"))
    for args in calls:
        op.dispatch(None, *args)
    ran = []
    for d in op._memo.values():
        d.fn = lambda *args, key=d.key: ran.append(key[0]) or args[0]
    for turn in range(3):
        for args in calls[: 2 + 2 * turn] * 3 + calls[::-1]:
            with torch.set_grad_enabled(turn != 1):
                ran.clear()
                op.dispatch(None, *args)
                assert ran == [op.key(*args)]
                assert len(op._fast) <= op_mod.FAST_RECORDS


def test_a_dims_guard_pins_only_the_sizes_it_names():
    from polykernel.core import hit_guard

    if not hit_guard.available():
        pytest.skip("this torch has no TensorGuards")
    a, b = torch.randn(2, 3, 4), torch.randn(5)
    check = hit_guard.build((hit_guard.dims(0, 2), hit_guard.dims()), (a, b))
    assert check(torch.randn(2, 7, 4), torch.randn(9))  # dim 1 and b's sizes are free
    assert not check(torch.randn(3, 3, 4), b)  # dim 0 is pinned
    assert not check(torch.randn(2, 3, 5), b)  # dim 2 is pinned
    assert not check(torch.randn(2, 3, 4, 1), b)  # so is the number of dims
    assert not check(a.double(), b)  # and the dtype
    with pytest.raises(ValueError):
        hit_guard.dims(-1)
