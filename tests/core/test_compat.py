"""polykernel._compat: each private API's fallback gives the same results as the private path, and
``POLYKERNEL_COMPAT_FALLBACKS=1`` switches every probe to its fallback (in a fresh process).

The fallbacks are tested here in-process, one at a time, by putting each in the place the private
API holds (the module globals the callers read); ``make test-fallbacks`` runs the whole CPU suite
with all of them forced at once."""

from __future__ import annotations

import contextvars
import inspect
import json
import os
import subprocess
import sys
import types

import pytest
import torch
import torch.autograd.forward_ad as fwAD

import polykernel
from polykernel import _compat
from polykernel.core import hit_guard, registry
from polykernel.core import hot_path as op_mod  # the generated hot path and the state it reads
from polykernel.ops.rms_norm import reference as rms_norm_reference

GUARDED = ["rms_norm", "layer_norm", "fused_add_rms_norm", "swiglu", "geglu"]


def _positional(op, case):
    """The impl's positional arguments of an example case (the reference's order, defaults filled)."""
    bound = inspect.signature(op.reference).bind(*case.args, **case.kwargs)
    bound.apply_defaults()
    return tuple(bound.arguments.values())


# -- the forced switch ---------------------------------------------------------------------------

_FORCED_REPORT = r"""
import json, torch
from polykernel import _compat
from polykernel.core import hit_guard, hot_path as op_mod
from polykernel.backends.triton import _autograd, _launch
from polykernel.compile import library

class Sq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * x

    @staticmethod
    def backward(ctx, g):
        return g

report = {
    "forced": _compat.FORCED,
    "compiling_expr": op_mod._COMPILING_EXPR,
    "tracing_expr": op_mod._TRACING_EXPR,
    "deterministic_public": op_mod._deterministic is torch.are_deterministic_algorithms_enabled,
    "capturing_public": op_mod._stream_capturing is torch.cuda.is_current_stream_capturing,
    "guard": hit_guard.available(),
    "lean_apply_is_apply": _autograd.lean_apply(Sq) == Sq.apply,
    "transforms_active": _compat.functorch_transforms_active(),
    "transforms_by_probe": _compat.functorch_transforms_active is _compat.autograd._transforms_active_by_probe,
    "fast_launch": _launch.ENABLED or _launch._JITFunction is not None or _launch._runtime_knobs is not None,
    "comptime": _compat.comptime() is not None,
    "autograd_guard": _compat.custom_ops._autograd_guard is not None,
    "schema_infos": _compat.dtensor_schema_infos() is not None,
    "hooks": _compat.module_has_hooks(torch.nn.Linear(2, 2)),
    "softmax_formula": _compat.softmax_backward_data is _compat.autograd._softmax_backward_formula,
    "storage_by_address": _compat.storage._storage_key is _compat.storage._data_ptr_id,
    "sleep_fallback": _compat.cuda_sleep is _compat.kernels._busy_matmuls,
}
report["fallbacks"] = sorted(_compat.fallbacks())  # the lazy probes were asked above
print(json.dumps(report))
"""


def test_forced_switch_takes_every_fallback():
    env = {**os.environ, "POLYKERNEL_COMPAT_FALLBACKS": "1", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    out = subprocess.run([sys.executable, "-c", _FORCED_REPORT], env=env, capture_output=True, text=True, check=True, timeout=300)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["forced"]
    assert r["compiling_expr"] == r["tracing_expr"] == "compiling()"
    assert r["deterministic_public"] and r["capturing_public"]
    assert r["guard"] is False
    assert r["lean_apply_is_apply"] and r["transforms_active"] is False and r["transforms_by_probe"]
    assert r["fast_launch"] is False
    assert not r["comptime"] and not r["autograd_guard"] and not r["schema_infos"]
    assert r["hooks"] is True
    assert r["softmax_formula"] and r["storage_by_address"] and r["sleep_fallback"]
    for name in (
        "deterministic_enabled",
        "stream_capturing",
        "compiling_flag",
        "tensor_guards",
        "function_apply",
        "functorch_transforms_active",
        "forward_ad_level",
        "any_autocast_enabled",
        "delayed_error",
        "cuda_sleep",
        "triton_jit_function",
        "triton_runtime_knobs",
        "autograd_keys_on",
        "comptime",
        "storage_id",
        "softmax_backward_data",
        "is_async_collective",
        "dtensor_schema_infos",
        "module_has_hooks",
        "assert_async",
        "grouped_mm",
    ):
        assert name in r["fallbacks"], name


# -- per-call flags ------------------------------------------------------------------------------


def test_deterministic_and_capture_flags_equal_the_public_ones():
    # Memo keys built with either must be equal: same bools.
    for on in (False, True):
        torch.use_deterministic_algorithms(on)
        try:
            assert _compat.deterministic_enabled() is torch.are_deterministic_algorithms_enabled() is on
        finally:
            torch.use_deterministic_algorithms(False)
    if torch.cuda.is_available():  # asked only for CUDA decisions (a CPU build has stubs that raise)
        assert _compat.stream_capturing() is torch.cuda.is_current_stream_capturing() is False


def test_forward_ad_fallback_still_carries_tangents_and_plain_calls_dispatch(monkeypatch):
    # Without the dual level's module global every call looks for tangents (the public unpack_dual):
    # a dual call gets the reference's tangent, a plain one its impl as before.
    monkeypatch.setattr(op_mod, "_FORWARD_AD_EXPR", "forward_ad_open()")
    monkeypatch.setattr(_compat, "forward_ad_open", _compat.autograd._dual_level_unknown)
    op = registry.get_op("rms_norm")
    fn = op_mod._hot_dispatch(op)
    x, t, w = torch.randn(4, 16), torch.randn(4, 16), torch.randn(16)
    want = rms_norm_reference(x, w)
    for _ in range(2):  # the second call: a guard hit
        torch.testing.assert_close(fn(None, x, w, 1e-6, 0.0, "fp32"), want)
    with fwAD.dual_level():
        y = fn(None, fwAD.make_dual(x, t), w, 1e-6, 0.0, "fp32")  # auto: Triton here
        ref = rms_norm_reference(fwAD.make_dual(x, t), w)
        torch.testing.assert_close(fwAD.unpack_dual(y).tangent, fwAD.unpack_dual(ref).tangent)


def test_compile_check_fallback_still_sends_compiled_calls_to_the_custom_op(monkeypatch):
    # The hot path generated with the public check (`compiling()`) puts the op's custom op in the
    # graph, as the inlined flag does, and eager calls still dispatch.
    monkeypatch.setattr(op_mod, "_COMPILING_EXPR", "compiling()")
    monkeypatch.setattr(op_mod, "_TRACING_EXPR", "compiling()")  # (no is_dynamo_compiling in this torch)
    op = registry.get_op("rms_norm")
    fn = op_mod._hot_dispatch(op)
    x, w = torch.randn(4, 16), torch.randn(16)

    def call(x, w):
        return fn(None, x, w)

    from polykernel.ops.rms_norm import reference

    torch.testing.assert_close(call(x, w), reference(x, w))  # eager: dispatched
    targets: list[str] = []

    def backend(gm, example_inputs):
        targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    torch._dynamo.reset()
    out = torch.compile(call, backend=backend, fullgraph=True)(x, w)
    torch.testing.assert_close(out, reference(x, w))
    assert any("polykernel.rms_norm" in t for t in targets), targets


@pytest.mark.parametrize("op_name", GUARDED)
def test_guard_fallback_dispatches_as_the_guard(monkeypatch, op_name):
    # Without TensorGuards each call builds its argument class in Python: the same decisions and
    # outputs, for the same variety of calls (dtypes, grad, scopes, a repeat).
    op = registry.get_op(op_name)
    calls = [
        _positional(op, op.example((4, 32), torch.float32, "cpu", False)),
        _positional(op, op.example((4, 32), torch.float32, "cpu", False)),
        _positional(op, op.example((2, 64), torch.bfloat16, "cpu", False)),
        _positional(op, op.example((3, 32), torch.float32, "cpu", True)),
    ]

    def run(dispatch):
        polykernel.clear_caches()
        outs = []
        for args in calls:
            outs.append(dispatch(None, *args))
            with polykernel.use_impl("torch"):
                outs.append(dispatch(None, *args))
        return outs, [(d["impl"], d["source"]) for d in polykernel.decisions(op.id)]

    guarded = run(op_mod._hot_dispatch(op))
    monkeypatch.setattr(hit_guard, "_tensor_guards", lambda: None)
    unguarded = run(op_mod._hot_dispatch(op))
    assert not op._fast
    assert guarded[1] == unguarded[1]
    for a, b in zip(guarded[0], unguarded[0]):
        for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
            torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_guard_fallback_rejects_a_bad_option_after_a_valid_call(monkeypatch):
    # Without the guard every call takes the slow path, with its option-type check: a tensor eps
    # or a bool offset equal (==) to the last call's options is an error, not a memo hit.
    from polykernel.errors import OpArgumentError

    monkeypatch.setattr(hit_guard, "_tensor_guards", lambda: None)
    op = registry.get_op("rms_norm")
    dispatch = op_mod._hot_dispatch(op)
    x, w = torch.randn(3, 8), torch.randn(8)
    dispatch(None, x, w, 1.0, 0.0, "fp32")
    for bad in ((torch.tensor(1.0), 0.0), (1.0, False)):
        with pytest.raises(OpArgumentError):
            dispatch(None, x, w, *bad, "fp32")
    torch.testing.assert_close(dispatch(None, x, w, 1.0, 0.0, "fp32"), op.reference(x, w, 1.0, 0.0, "fp32"))


# -- autograd ------------------------------------------------------------------------------------


class _Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, k):
        ctx.save_for_backward(x)
        ctx.k = k
        return k * x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * ctx.k * x * g, None


@pytest.mark.parametrize("fallback", ["function_apply", "functorch_transforms_active"])
def test_lean_apply_fallbacks_record_the_same_gradient(monkeypatch, fallback):
    from polykernel.backends.triton import _autograd

    if fallback == "function_apply":
        monkeypatch.setattr(_compat.autograd, "_c_apply", None)
    else:
        monkeypatch.setattr(_compat, "functorch_transforms_active", _compat.autograd._transforms_active_by_probe)
    apply = _autograd.lean_apply(_Square)
    x = torch.randn(5, requires_grad=True)
    (g,) = torch.autograd.grad(apply(x, 3.0).sum(), x)
    torch.testing.assert_close(g, 6 * x.detach())
    assert apply(x, 3.0).grad_fn.name() == _Square.apply(x, 3.0).grad_fn.name()  # the same node type


def test_transforms_probe_agrees_with_the_private_flag():
    private = getattr(torch._C, "_are_functorch_transforms_active", None)
    seen = []

    def f(x):
        seen.append((_compat.autograd._transforms_active_by_probe(), private() if private else True))
        return (x * x).sum()

    seen.append((_compat.autograd._transforms_active_by_probe(), private() if private else False))
    torch.func.vmap(f)(torch.randn(3, 2))
    torch.func.grad(f)(torch.randn(3))
    torch.func.jvp(f, (torch.randn(2),), (torch.randn(2),))
    assert seen == [(False, False), (True, True), (True, True), (True, True)]


def test_autocast_fallback_agrees_with_the_private_flag():
    private = getattr(torch._C, "_is_any_autocast_enabled", None)
    assert _compat.dispatch._any_autocast_by_device() is False and (private is None or private() is False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _compat.dispatch._any_autocast_by_device() is True and (private is None or private() is True)


def test_delayed_error_fallback_passes_values_and_raises_in_backward():
    x = torch.randn(4, requires_grad=True)
    for make in (_compat.delayed_error, _compat.autograd._delayed_error_function):
        y, none = make("no double backward here", 2)(x * 2, None)
        assert none is None and y.requires_grad
        torch.testing.assert_close(y, x.detach() * 2)
        with pytest.raises(RuntimeError, match="no double backward here"):
            y.sum().backward()


def test_fresh_thread_runs_autograd_inside_a_custom_op_kernel():
    # Below autograd (a custom op's kernel), grad mode alone records nothing; the fallback's fresh
    # thread does, and carries the caller's context variables and raises its errors.
    var = contextvars.ContextVar("v", default="unset")

    @torch.library.custom_op("polykernel_test::sq_grad", mutates_args=())
    def sq_grad(x: torch.Tensor) -> torch.Tensor:
        def body():
            assert var.get() == "set"
            with torch.enable_grad():
                leaf = x.detach().requires_grad_(True)
                return torch.autograd.grad((leaf * leaf).sum(), leaf)[0]

        return _compat.custom_ops._on_fresh_thread(body)

    token = var.set("set")
    try:
        x = torch.randn(4)
        torch.testing.assert_close(sq_grad(x), 2 * x)
    finally:
        var.reset(token)
    with pytest.raises(ZeroDivisionError):
        _compat.custom_ops._on_fresh_thread(lambda: 1 / 0)


def test_backward_custom_op_recomputes_the_same_gradients_without_the_guard(monkeypatch):
    # polykernel::rms_norm_backward recomputes the forward through autograd inside its kernel: on
    # a fresh thread when the dispatch-key guard is missing, with the same gradients.
    from polykernel.compile import library

    op = registry.get_op("rms_norm")
    compiled = library._built.get(op.id) or library._build(op)
    x, w, g = torch.randn(6, 32), torch.randn(32), torch.randn(6, 32)
    mask = [True, True, False, False, False]  # one per argument
    want = compiled.backward([g], x, w, 1e-6, 0.0, "fp32", mask)
    monkeypatch.setattr(_compat.custom_ops, "_autograd_guard", None)
    got = compiled.backward([g], x, w, 1e-6, 0.0, "fp32", mask)
    assert len(got) == len(want) == 2
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with _compat.autograd_keys_on():  # the fake impls' fallback: no guard, no error
        pass


def test_trace_time_fallback_runs_the_action_while_tracing(monkeypatch):
    # Without comptime, a no-op custom op's fake impl runs the action while Dynamo traces: once
    # per trace, none when the compiled graph runs again; fullgraph holds.
    from polykernel.compile import library

    seen: list[tuple[str, ...]] = []
    monkeypatch.setitem(library._TRACE_TIME, "test_action", lambda *a: seen.append(a))
    for comptime in (_compat.comptime, lambda: None):
        monkeypatch.setattr(_compat, "comptime", comptime)
        seen.clear()
        torch._dynamo.reset()

        def f(x):
            library._at_trace_time("test_action", "a", "b")
            return x + 1

        g = torch.compile(f, fullgraph=True, backend="aot_eager")
        x = torch.randn(3)
        torch.testing.assert_close(g(x), x + 1)
        assert seen and set(seen) == {("a", "b")}, comptime
        n = len(seen)
        g(torch.randn(3))
        assert len(seen) == n  # nothing at run time


# -- torch.library, storage, softmax --------------------------------------------------------------


def test_custom_op_overload_fallback_is_the_same_overload():
    from polykernel.compile import library

    op = registry.get_op("rms_norm")
    compiled = library._built.get(op.id) or library._build(op)
    assert _compat.custom_op_overload(types.SimpleNamespace(), compiled.qualname) is compiled.forward
    assert _compat.custom_op_overload(types.SimpleNamespace(), f"{compiled.qualname}_backward") is compiled.backward


def test_storage_id_fallback_tells_aliases_apart_as_the_private_one(monkeypatch):
    from polykernel.compile import library

    a = torch.randn(4, 4)
    for key in (_compat.storage._storage_key, _compat.storage._data_ptr_id):
        monkeypatch.setattr(_compat.storage, "_storage_key", key)
        assert _compat.storage_id(a) == _compat.storage_id(a[1:]) == _compat.storage_id(a.t())
        assert _compat.storage_id(a) != _compat.storage_id(a.clone())
        out = library._fresh([a[1:], a.clone()], [a])  # a view of an input is copied, a fresh tensor kept
        assert _compat.storage_id(out[0]) != _compat.storage_id(a)
        torch.testing.assert_close(out[0], a[1:])


def test_softmax_backward_fallback_matches_the_exact_gradient():
    x = torch.randn(6, 50, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(6, 50, dtype=torch.float64)
    (exact,) = torch.autograd.grad(torch.softmax(x, -1), x, dy)
    y = torch.softmax(x.detach().float(), -1)
    for fn in (_compat.softmax_backward_data, _compat.autograd._softmax_backward_formula):
        got = fn(dy.float(), y, -1, torch.float32)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-6)


# -- torch.distributed, nn -------------------------------------------------------------------------


def test_async_collective_check_by_name_agrees_with_the_class(monkeypatch):
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    act, plain = AsyncCollectiveTensor(torch.randn(3)), torch.randn(3)
    for forced in (False, True):
        monkeypatch.setattr(_compat.distributed, "FORCED", forced)  # the global is_async_collective reads
        assert _compat.is_async_collective(act) and not _compat.is_async_collective(plain)
    # (not polykernel.distributed.dtensor._waited here: importing that module routes subclass
    # calls for the rest of the process, which tests/core/test_subclass_guard.py does not expect)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
def test_without_schema_infos_no_sharding_rule_is_registered(monkeypatch):
    # DTensor's strategy cache cannot be widened: no rule (which could reuse one call's output
    # shapes for a call with other options), and the training ops say why they decompose.
    from torch.distributed.tensor import experimental

    from polykernel.compile import library, sharding

    monkeypatch.setattr(_compat, "dtensor_schema_infos", lambda: None)
    monkeypatch.setattr(sharding, "_done", set())
    monkeypatch.setattr(sharding, "_trained", set())
    monkeypatch.setattr(sharding, "_rules_off", False)
    monkeypatch.setattr(sharding, "_layouts", {})
    monkeypatch.setattr(experimental, "register_sharding", lambda *a, **k: pytest.fail("a rule was registered"))
    op = registry.get_op("rms_norm")
    sharding.register(op, library._built.get(op.id) or library._build(op))
    assert op.id in sharding._done and op.id not in sharding._trained
    assert sharding.why_not(op.id, ()) == sharding._NO_RULES


def test_module_hooks_fallback_leaves_modules_alone(monkeypatch):
    lin = torch.nn.Linear(2, 2)
    assert not _compat.module_has_hooks(lin) or _compat.FORCED
    assert not _compat.module_hooks_seen(lin)
    handle = lin.register_forward_hook(lambda *a: None)
    assert _compat.module_has_hooks(lin) and (_compat.module_hooks_seen(lin) or _compat.FORCED)
    handle.remove()
    monkeypatch.setattr(_compat.hooks, "_hooks_readable", False)
    assert _compat.module_has_hooks(lin)  # cannot tell: treated as hooked
    assert not _compat.module_hooks_seen(lin)  # ... or as not hooked, by callers that fuse past it by default


def test_fully_shard_is_found():
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    assert callable(_compat.fully_shard())


# -- CUDA ----------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_fallbacks_match_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    dev = torch.cuda.current_device()
    assert torch.cuda.current_device() == _compat.cuda_current_device() == dev
    assert _compat.kernels._public_raw_stream(dev) == _compat.cuda_raw_stream(dev) == torch.cuda.current_stream().cuda_stream
    # the busy-kernel fallback holds the stream at least about as long as asked (a lower bound)
    cycles = 20_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    _compat.kernels._busy_matmuls(cycles)  # calibrates
    torch.cuda.synchronize()
    start.record()
    _compat.kernels._busy_matmuls(cycles)
    end.record()
    end.synchronize()
    assert start.elapsed_time(end) >= 0.5 * cycles / _compat.kernels._clock_khz(dev)
