"""The tensor-subclass guard: an impl that reads raw memory (Triton, CuTe, peers) is never handed a
tensor subclass (a DTensor, a ``__torch_dispatch__`` wrapper, a ``__torch_function__`` subclass);
only impls that declare ``accepts_subclasses`` (the torch impl of every op) are eligible, a strict
choice of another one raises, and ``explain`` says why. ``torch.nn.Parameter`` stays plain.

On the CPU, TRITON_INTERPRET=1 (conftest) makes the Triton impls eligible, so without the guard
they would be chosen for these calls.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from torch.utils._pytree import tree_map

import polykernel
from polykernel.core import registry
from polykernel.core.op import Case, Op
from polykernel.errors import ImplNotAvailableError
from polykernel.ops import OP_MODULES

OP_IDS = list(OP_MODULES)
REASON = "this impl reads raw memory"


class Wrapper(torch.Tensor):
    """A minimal ``__torch_dispatch__`` wrapper subclass (no storage of its own, like DTensor)."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> Wrapper:
        return torch.Tensor._make_wrapper_subclass(
            cls, inner.shape, strides=inner.stride(), dtype=inner.dtype, device=inner.device, requires_grad=inner.requires_grad
        )

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner

    def __repr__(self) -> str:
        return f"Wrapper({self.inner!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def unwrap(t):
            return t.inner if isinstance(t, Wrapper) else t

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        return tree_map(lambda t: Wrapper(t) if isinstance(t, torch.Tensor) else t, out)


class Tracked(torch.Tensor):
    """A ``__torch_function__`` subclass (has real storage: a raw-memory kernel would run on it)."""

    calls = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.calls += 1
        return super().__torch_function__(func, types, args, kwargs or {})


def _wrap(t):
    return Wrapper(t) if isinstance(t, torch.Tensor) else t


def _track(t):
    return t.as_subclass(Tracked) if isinstance(t, torch.Tensor) else t


def _plain(t):
    if isinstance(t, Wrapper):
        return t.inner
    if isinstance(t, torch.Tensor) and type(t) is not torch.Tensor:
        return t.as_subclass(torch.Tensor)
    return t


SUBCLASSES = {"Wrapper": _wrap, "Tracked": _track}


def _op(op_id: str) -> Op:
    try:
        importlib.import_module(OP_MODULES[op_id])
    except Exception as exc:  # another agent's op file may be mid-edit
        pytest.skip(f"{op_id}: module {OP_MODULES[op_id]} does not import ({type(exc).__name__}: {exc})")
    return registry.get_op(op_id)


def _raw_op(op_id: str) -> Op:
    """``_op``, for the tests whose premise is a Triton impl: an op with only torch impls (the
    MoE router) has nothing that reads raw memory, so nothing for the guard to keep away."""
    op = _op(op_id)
    if "triton" not in registry.specs_for(op):
        pytest.skip(f"{op_id} has no Triton impl")
    return op


def _case(op: Op) -> Case:
    """The smallest non-empty fp32 parity case, its tensors detached (forward only)."""
    cases = [c for c in op.cases("cpu", torch.float32) if all(a.numel() > 0 for a in c.args if isinstance(a, torch.Tensor))]
    case = min(cases, key=lambda c: sum(a.numel() for a in c.args if isinstance(a, torch.Tensor)))
    return Case(case.label, tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in case.args), case.kwargs)


def _flat(out):
    """The output tensors, nested NamedTuples (the fused preference losses' metrics) flattened."""
    if isinstance(out, tuple):
        return [t for o in out for t in _flat(o)]
    return [] if out is None else [out]


def _outputs(out):
    # fp8 values (the serving quantisers) compared as fp32: torch compares no fp8 with a tolerance
    return [o.float() if o.dtype == torch.float8_e4m3fn else o for o in map(_plain, _flat(out))]


# Ops whose torch impl writes its results into fresh plain tensors (the fused preference/RL
# losses' chunked driver): a subclass input still never reaches a raw-memory impl, but the
# outputs are plain tensors.
PLAIN_OUTPUTS = {f"loss.fused_linear_{n}_loss" for n in ("dpo", "orpo", "cpo", "simpo", "kto", "grpo")}


@pytest.fixture
def raw_calls(monkeypatch):
    """Wrap every impl that does not accept subclasses (Triton, peers) so that each call is
    recorded with the argument types; the wrapped impls still run on plain tensors."""
    calls: list[tuple[str, str, list[str]]] = []

    def install(op: Op) -> None:
        for name, spec in registry.specs_for(op).items():
            if spec.accepts_subclasses:
                continue
            try:
                fn = registry.load_impl(spec)
            except Exception:  # not importable here: never runs anyway
                continue

            def counted(*args, _fn=fn, _name=name):
                calls.append((op.id, _name, [type(a).__name__ for a in args if isinstance(a, torch.Tensor)]))
                return _fn(*args)

            monkeypatch.setitem(registry.REGISTRY._preloaded, (op.id, name), counted)
        polykernel.clear_caches()  # memoized decisions hold the unwrapped callables

    yield install, calls
    polykernel.clear_caches()


def test_torch_impls_accept_subclasses_and_others_do_not():
    for op_id in OP_IDS:
        try:
            specs = registry.specs_for(_op(op_id))
        except pytest.skip.Exception:
            continue
        assert specs["torch"].accepts_subclasses, op_id
        for name, spec in specs.items():
            if name != "torch":
                assert not spec.accepts_subclasses, (op_id, name)


@pytest.mark.parametrize("kind", list(SUBCLASSES))
@pytest.mark.parametrize("op_id", OP_IDS)
def test_subclass_never_reaches_a_raw_memory_impl(op_id, kind, raw_calls):
    install, calls = raw_calls
    op = _raw_op(op_id)
    install(op)
    public = getattr(polykernel, op.name)
    case = _case(op)
    # The premise: for plain tensors a raw-memory impl (Triton through the interpreter) runs.
    chosen = polykernel.explain(op_id, *case.args, **case.kwargs).chosen
    assert chosen != "torch", f"{op_id}: the test needs a raw-memory impl to be chosen for plain tensors"
    want = _outputs(public(*case.args, **case.kwargs))
    assert calls and calls[-1][1] == chosen
    n = len(calls)

    args = tuple(SUBCLASSES[kind](a) for a in case.args)
    got = public(*args, **case.kwargs)  # the plain decision is memoized: the guard must see it
    got_again = public(*args, **case.kwargs)  # and the subclass decision, memoized too
    assert calls[n:] == [], f"{op_id}: a raw-memory impl ran on a {kind}: {calls[n:]}"
    for g, w in zip(_outputs(got), want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, equal_nan=True)
    for g, w in zip(_outputs(got_again), want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, equal_nan=True)
    if op_id not in PLAIN_OUTPUTS:
        assert type((got if isinstance(got, tuple) else (got,))[0]).__name__ == kind  # torch's dispatch kept it

    record = [d for d in polykernel.decisions(op_id) if d.get("subclass") == kind]
    assert [d["impl"] for d in record] == ["torch"]
    assert any(name == chosen and REASON in why for name, why in record[0]["skipped"])

    # A subclass in any tensor position (not only the first) is seen.
    last = max(i for i, a in enumerate(case.args) if isinstance(a, torch.Tensor))
    mixed = tuple(SUBCLASSES[kind](a) if i == last else a for i, a in enumerate(case.args))
    public(*mixed, **case.kwargs)
    assert calls[n:] == [], f"{op_id}: a raw-memory impl ran with a {kind} at position {last}"

    # Plain tensors still get the raw-memory impl afterwards.
    public(*case.args, **case.kwargs)
    assert len(calls) == n + 1 and calls[-1][1] == chosen


@pytest.mark.parametrize("op_id", OP_IDS)
def test_strict_raw_impl_on_a_subclass_raises_with_the_reason(op_id):
    op = _raw_op(op_id)
    case = _case(op)
    public = getattr(polykernel, op.name)
    public(*case.args, impl="triton", **case.kwargs)  # memoize the plain strict decision first
    args = tuple(_wrap(a) for a in case.args)
    with pytest.raises(ImplNotAvailableError) as info:
        public(*args, impl="triton", **case.kwargs)
    err = info.value
    assert (err.op, err.impl) == (op_id, "triton")
    assert err.reason == f"input is a tensor subclass (Wrapper); {REASON}"
    assert err.runnable == ["torch"]
    with polykernel.use_impl("triton", op=op_id), pytest.raises(ImplNotAvailableError, match="tensor subclass"):
        public(*args, **case.kwargs)


@pytest.mark.parametrize("op_id", OP_IDS)
def test_explain_names_the_subclass(op_id):
    op = _raw_op(op_id)
    case = _case(op)
    e = polykernel.explain(op_id, *(_wrap(a) for a in case.args), **case.kwargs)
    assert e.chosen == "torch"
    reasons = {r["name"]: r["reason"] for r in e.impls}
    assert reasons["triton"] == f"input is a tensor subclass (Wrapper); {REASON}"
    assert "input is a tensor subclass (Wrapper); this impl reads raw memory" in str(e)
    plain = polykernel.explain(op_id, *case.args, **case.kwargs)
    assert {r["name"]: r["reason"] for r in plain.impls}["triton"] is None


def test_parameter_stays_on_the_fast_path(raw_calls):
    install, calls = raw_calls
    op = _op("norm.rms_norm")
    install(op)
    x, w = torch.randn(3, 16), torch.nn.Parameter(torch.randn(16))
    with torch.no_grad():
        polykernel.rms_norm(x, w)
        polykernel.rms_norm(torch.nn.Parameter(x), w)
    assert [c[1] for c in calls] == ["triton", "triton"]
    assert not any("subclass" in d for d in polykernel.decisions("rms_norm"))


def test_subclass_first_call_records_only_what_ran(raw_calls):
    install, calls = raw_calls
    install(_op("norm.rms_norm"))
    x, w = Wrapper(torch.randn(3, 16)), torch.randn(16)
    polykernel.rms_norm(x, w)
    assert calls == []
    assert [(d["impl"], d.get("subclass")) for d in polykernel.decisions("rms_norm")] == [("torch", "Wrapper")]


def test_subclass_with_autograd():
    x = torch.randn(4, 32, requires_grad=True)
    w = torch.randn(32, requires_grad=True)
    xs, ws = x.detach().as_subclass(Tracked).requires_grad_(), w.detach().as_subclass(Tracked).requires_grad_()
    y = polykernel.rms_norm(xs, ws)
    y.sum().backward()
    ref = polykernel.rms_norm(x, w, impl="torch")
    ref.sum().backward()
    torch.testing.assert_close(y.as_subclass(torch.Tensor), ref.detach())
    torch.testing.assert_close(xs.grad.as_subclass(torch.Tensor), x.grad)
    torch.testing.assert_close(ws.grad.as_subclass(torch.Tensor), w.grad)
    assert [d["impl"] for d in polykernel.decisions("rms_norm") if d.get("subclass") == "Tracked"] == ["torch"]


# ---------------------------------------------------------------------------------------------
# A real DTensor, on a one-process gloo world


@pytest.fixture
def cpu_mesh():
    dist = torch.distributed
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this build")
    from torch.distributed.device_mesh import DeviceMesh

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield DeviceMesh("cpu", [0])
    finally:
        if created:
            dist.destroy_process_group()


def test_dtensor_runs_the_raw_impl_on_local_shards_only(cpu_mesh, raw_calls):
    # Issue 13: a DTensor goes to polykernel.distributed.dtensor, which runs the chosen impl on its local
    # shards (plain tensors); the raw-memory impl never sees the DTensor itself.
    # Multi-rank cases: tests/test_dtensor.py.
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    install, calls = raw_calls
    install(_op("norm.rms_norm"))
    x, w = torch.randn(6, 48), 1 + 0.1 * torch.randn(48)
    assert polykernel.explain("rms_norm", x, w).chosen == "triton"
    want = polykernel.rms_norm(x, w, offset=0.5)
    n = len(calls)
    dx, dw = distribute_tensor(x, cpu_mesh, [Shard(0)]), distribute_tensor(w, cpu_mesh, [Replicate()])
    got = polykernel.rms_norm(dx, dw, offset=0.5)
    assert [c[1] for c in calls[n:]] == ["triton"] and all(set(c[2]) == {"Tensor"} for c in calls[n:])
    assert type(got).__name__ == "DTensor"
    torch.testing.assert_close(got.full_tensor(), want, rtol=1e-5, atol=1e-5)
    text = str(polykernel.explain("rms_norm", dx, dw, offset=0.5))
    assert "route: DTensor Shard(0) on mesh of 1: triton on local shards" in text
    polykernel.rms_norm(dx, dw, impl="torch")
    assert len(calls) == n + 1


def test_compiled_calls_keep_the_raw_memory_impl(raw_calls):
    # Under torch.compile the op is a custom op: Dynamo traces fake tensors, but its real impl
    # runs the dispatcher on plain tensors, so the guard must not exclude the Triton impl there.
    import torch._dynamo

    install, calls = raw_calls
    install(_op("norm.rms_norm"))
    x, w = torch.randn(3, 16), torch.randn(16)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(lambda a, b: polykernel.rms_norm(a, b), fullgraph=True, backend="aot_eager")
        with torch.no_grad():
            got = compiled(x, w)
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(got, polykernel.rms_norm(x, w, impl="torch"))
    assert calls and all(c[1] == "triton" and set(c[2]) == {"Tensor"} for c in calls)
    assert not any("subclass" in d for d in polykernel.decisions("rms_norm"))
