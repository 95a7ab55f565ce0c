"""torch.compile integration (polykernel.compile.library): every op is a ``polykernel::<name>`` custom op
with a fake impl and autograd, so ``torch.compile(fullgraph=True)`` has no graph break, forward
and backward; ``opcheck`` passes; dispatcher state is read at run time inside compiled code.

Parametrized over every op in the catalog; an op whose module does not import yet is skipped.
CPU tests use the smallest non-empty parity cases (inductor on the CPU compiles C++: only a few
inductor tests run there). GPU tests (``-m gpu``) run inductor for every op, forward and backward;
``test_compile_cuda.py`` runs ``opcheck`` and a CUDA graph on the GPU.
"""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch
import torch._dynamo.testing

import polykernel
from polykernel.compile import library
from polykernel.core import registry
from polykernel.core import selection as dispatch
from polykernel.core.op import Case, Op
from polykernel.errors import OpArgumentError
from polykernel.ops import OP_MODULES
from polykernel.spec import Split
from polykernel.testing import fresh

OP_IDS = list(OP_MODULES)


def _slow_for(*slow: str) -> list:
    """OP_IDS, with the ops whose compile takes over ~5 s on 2 CPU cores (--durations) marked
    ``slow``: ``-m "not slow"`` leaves them out of a quick loop; CI runs them."""
    assert set(slow) <= set(OP_IDS), set(slow) - set(OP_IDS)
    return [pytest.param(op_id, marks=pytest.mark.slow) if op_id in slow else op_id for op_id in OP_IDS]


@pytest.fixture(autouse=True)
def _dynamo_reset():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _op(op_id: str) -> Op:
    try:
        importlib.import_module(OP_MODULES[op_id])
    except Exception as exc:  # another agent's op file may not be there yet
        pytest.skip(f"{op_id}: module {OP_MODULES[op_id]} does not import ({type(exc).__name__}: {exc})")
    return registry.get_op(op_id)


def _public(op: Op):
    return getattr(polykernel, op.name)


def _overloads(op: Op):
    """(CompiledOp, forward, backward); backward None for an op that writes into given tensors
    (Op.writes: the serving ops, inference only)."""
    compiled = library._built[op.id]
    if compiled.mode == "eager":  # a graph break around the eager call: no custom op (test_eager_mode_* below)
        pytest.skip(f"{op.id}: compile_mode eager, no custom op")
    packet = getattr(torch.ops.polykernel, compiled.name)
    backward = None if compiled.writes else getattr(torch.ops.polykernel, f"{compiled.name}_backward").default
    return compiled, packet.default, backward


def _expected_node(op: Op, case: Case):
    """The custom op a compiled call of ``case`` puts in the graph: the training op when an
    input needs a gradient, else the forward op; None when the op decomposes under compile."""
    compiled = library._built[op.id]
    if compiled.mode == "decompose" and not case.kwargs.get("impl"):
        return None
    if compiled.writes:
        return compiled.forward
    grad = any(isinstance(a, torch.Tensor) and a.requires_grad for a in case.args)
    return compiled.train if grad else compiled.forward


def _first_numel(case: Case) -> int:
    return next(a.numel() for a in case.args if isinstance(a, torch.Tensor))


def _small_cases(op: Op, device="cpu", dtype=torch.float32, n=2) -> list[Case]:
    """The ``n`` smallest cases whose first tensor is not empty, preferring ones with options."""
    cases = [c for c in op.cases(device, dtype) if _first_numel(c) > 0]
    cases.sort(key=lambda c: sum(a.numel() for a in c.args if isinstance(a, torch.Tensor)))
    picked = cases[:1]
    with_kwargs = [c for c in cases[1:] if c.kwargs]
    picked += (with_kwargs or cases[1:])[: n - 1]
    if not picked:
        pytest.skip(f"{op.id}: no non-empty parity case")
    return picked


def _tuple(out):
    return out if isinstance(out, tuple) else (out,)


def _with_destinations(op, case: Case) -> tuple[tuple, dict]:
    """Every argument positional and each written tensor given (allocated like the reference's
    result where the case leaves it None), as the public function calls the custom op. torch 2.11
    (the H200's) finds a mutating custom op's written arguments by position without filling the
    defaults, so an omitted ``out`` fails ``opcheck`` with an IndexError inside torch."""
    bound = inspect.signature(op.reference).bind(*case.args, **case.kwargs)
    bound.apply_defaults()
    args = dict(bound.arguments)
    made = _tuple(op.reference(*[fresh(a) for a in bound.args]))
    for name, result in zip(op.writes, made):
        if args[name] is None:
            args[name] = torch.empty_like(result)
    return tuple(args.values()), {}


def _opcheck_with_destinations(fwd, op, case: Case) -> None:
    """``opcheck`` of a writing op given its destinations. torch's schema check compares each
    tensor before and after with ``allclose``, which float8 lacks: an fp8 destination is checked
    by the other three (the fake impl and AOT dispatch see the mutation the schema declares)."""
    args, kwargs = _with_destinations(op, case)
    fp8 = any(isinstance(a, torch.Tensor) and a.dtype.itemsize == 1 and a.is_floating_point() for a in args)
    utils = ("test_schema",) * (not fp8) + ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(fwd, args, kwargs, test_utils=utils)


def _run(fn, case: Case, seed: int = 0):
    """Outputs and gradients (random cotangents from ``seed``) of ``fn`` on fresh copies of the case."""
    args = [fresh(a) for a in case.args]
    outs = _tuple(fn(*args))
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    diff = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
    grads = ()
    if leaves and diff:
        gen = torch.Generator(device=diff[0].device).manual_seed(seed)
        cot = [torch.randn(o.shape, generator=gen, device=o.device, dtype=o.dtype) for o in diff]
        grads = torch.autograd.grad(diff, leaves, cot, allow_unused=True)
    return [o.detach() for o in outs], list(grads)


def _assert_same(op: Op, case: Case, got, want, dtype, what: str):
    """Two runs of one op (compiled and eager, say): each is within the op's error model of the
    exact result, so they are within twice that of each other."""
    (out_g, grad_g), (out_w, grad_w) = got, want
    assert len(out_g) == len(out_w) and len(grad_g) == len(grad_w), what
    bounds = op.error_model(*case.args, **case.kwargs)
    leaves = [i for i, a in enumerate(case.args) if isinstance(a, torch.Tensor) and a.requires_grad]

    def close(g, w, model, msg):
        d = w.dtype if w.dtype == torch.float8_e4m3fn else dtype  # fp8 outputs (serving's quantisers): their own roundoff
        tol = model.tol(d, w.detach().double().nan_to_num().abs().max().item() if w.numel() else 0.0)
        if d == torch.float8_e4m3fn:  # no arithmetic in fp8: compare the values
            g, w = g.double(), w.double()
        torch.testing.assert_close(g, w, atol=2 * tol.atol, rtol=2 * tol.rtol, equal_nan=True, msg=msg)

    for i, (g, w) in enumerate(zip(out_g, out_w)):
        close(g, w, bounds.output(i), lambda m, i=i: f"{what}: output {i}: {m}")
    for i, (g, w) in enumerate(zip(grad_g, grad_w)):
        assert (g is None) == (w is None), f"{what}: gradient {i} is {'missing' if g is None else 'unexpected'}"
        if g is not None:
            close(g, w, bounds.grads[leaves[i]], lambda m, i=i: f"{what}: grad {i}: {m}")


def _compiled(op: Op, case: Case, backend, **compile_kwargs):
    public, kwargs = _public(op), dict(case.kwargs)

    def fn(*args):
        return public(*args, **kwargs)

    return torch.compile(fn, fullgraph=True, backend=backend, **compile_kwargs)


def _targets(gm: torch.fx.GraphModule) -> set:
    return {n.target for n in gm.graph.nodes if n.op == "call_function"}


# ---------------------------------------------------------------------------------------------
# Every op


@pytest.mark.parametrize("op_id", OP_IDS)
def test_custom_op_schema_follows_reference(op_id):
    op = _op(op_id)
    assert op_id not in library.build_errors(), library.build_errors()[op_id]
    compiled, fwd, bwd = _overloads(op)
    names = list(inspect.signature(op.reference).parameters)
    schema = fwd._schema
    if compiled.writes:  # one mutating custom op: the written tensors marked, nothing returned, no autograd ops
        assert [a.name for a in schema.arguments] == [*names, "impl"]
        assert [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write] == sorted(
            op.writes, key=names.index
        )
        assert not schema.returns and bwd is None and compiled.train is None
        assert library.custom_op_for(op) is compiled.call
        return
    assert [a.name for a in schema.arguments] == [*names, "impl"]
    assert schema.arguments[-1].kwarg_only and str(schema.arguments[-1].type) == "Optional[str]"
    assert all(a.alias_info is None for a in schema.arguments)  # functional: mutates nothing
    assert [a.name for a in bwd._schema.arguments] == ["grad_outputs", *names, "grad_mask", "impl"]
    assert [a.name for a in compiled.train._schema.arguments] == [*names, "grad_mask", "impl"]
    # Fixed arity (DTensor's register_sharding places each return): the outputs, then the op's
    # saved tensors; the backward takes them one by one and returns one tensor per tensor argument.
    n_out, n_saved = len(fwd._schema.returns), len(op.saved or ())
    assert [str(r.type) for r in compiled.train._schema.returns] == ["Tensor"] * (n_out + n_saved)
    head = [f"grad_output_{i}" for i in range(n_out)] + [f"saved_{i}" for i in range(n_saved)]
    assert [a.name for a in compiled.train_backward._schema.arguments] == [*head, *names, "grad_mask", "impl"]
    n_tensors = sum(str(a.type) in ("Tensor", "Optional[Tensor]") for a in fwd._schema.arguments)
    assert [str(r.type) for r in compiled.train_backward._schema.returns] == ["Tensor"] * n_tensors
    assert all(a.alias_info is None for a in (*compiled.train._schema.arguments, *compiled.train_backward._schema.arguments))
    assert library.custom_op_for(op) is library.custom_op_for(op_id) is compiled.call


@pytest.mark.parametrize("op_id", _slow_for("loss.jsd", "loss.tvd", "loss.fused_linear_jsd"))
def test_opcheck(op_id):
    op = _op(op_id)
    _, fwd, _ = _overloads(op)
    for case in _small_cases(op):
        torch.library.opcheck(fwd, case.args, case.kwargs)
        if op.writes:
            _opcheck_with_destinations(fwd, op, case)
        no_grad_args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in case.args)
        torch.library.opcheck(fwd, no_grad_args, case.kwargs, test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("op_id", _slow_for("moe.moe_experts", "moe.moe_experts_gpt_oss"))
def test_opcheck_training_ops(op_id):
    """The training forward (outputs + saved) and its backward pass opcheck, backward included."""
    op = _op(op_id)
    compiled = _overloads(op)[0]
    if compiled.writes:
        pytest.skip(f"{op_id} writes into given tensors: inference only, no training custom ops")
    for case in _small_cases(op):
        names = list(inspect.signature(op.reference).parameters)
        bound = inspect.signature(op.reference).bind(*case.args, **case.kwargs)
        bound.apply_defaults()
        args = [bound.arguments[n] for n in names]
        mask = [isinstance(a, torch.Tensor) and a.requires_grad for a in args]
        torch.library.opcheck(compiled.train, (*args, mask))
        got = compiled.train(*[a.detach() if isinstance(a, torch.Tensor) else a for a in args], mask)
        got = got if isinstance(got, tuple) else (got,)
        outs, saved = got[: len(compiled.returns)], got[len(compiled.returns) :]
        assert len(saved) == len(compiled.saved_kinds)
        grads = [torch.randn_like(o) if o.is_floating_point() else None for o in outs]
        detached = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
        bwd_args = (*grads, *saved, *detached, mask)
        torch.library.opcheck(compiled.train_backward, bwd_args, test_utils=("test_schema", "test_faketensor"))
        # One tensor per tensor argument: the gradient where asked for, else an empty placeholder.
        back = compiled.train_backward(*bwd_args)
        back = back if isinstance(back, tuple) else (back,)
        for i, g in zip(compiled.tensor_args, back):
            a = args[i]
            assert g.shape == (a.shape if mask[i] else (0,) * (a.dim() if isinstance(a, torch.Tensor) else 1)), (op_id, i)


@pytest.mark.parametrize(
    "op_id",
    _slow_for(
        "moe.moe_experts",
        "moe.moe_router",
        "moe.moe_experts_gpt_oss",
        "loss.fused_linear_cross_entropy",
        "serving.fused_add_rms_norm_",
        "serving.rotary_embedding_",
        "serving.dynamic_quant_fp8",
        "embedding.mrope",
    ),
)
def test_aot_eager_fullgraph_matches_eager(op_id):
    op = _op(op_id)
    _overloads(op)  # built
    for case in _small_cases(op):
        counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
        compiled = _compiled(op, case, counter)
        got = _run(compiled, case)
        want = _run(lambda *a, case=case: _public(op)(*a, **case.kwargs), case)
        _assert_same(op, case, got, want, torch.float32, f"{op_id} {case.label} aot_eager")
        assert counter.frame_count == 1
        node, targets = _expected_node(op, case), _targets(counter.graphs[0])
        if node is None:  # decomposed: Inductor sees the reference's torch ops, nothing opaque
            assert not any(str(t).startswith("polykernel.") for t in targets), targets
        else:
            assert node in targets, "the op must be one custom-op node in the Dynamo graph"


@pytest.mark.parametrize("op_id", OP_IDS)
def test_compiled_and_eager_share_decisions(op_id):
    # The custom op's real impl builds the dispatcher's memo key itself (it cannot go through
    # Op.call while compiling): it must build the same key as the public function.
    op = _op(op_id)
    _, fwd, _ = _overloads(op)
    case = _small_cases(op, n=1)[0]
    args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in case.args)
    dispatch.clear_caches()
    with torch.no_grad():
        fwd(*args, **case.kwargs)
        keys = set(op._memo)
        _public(op)(*args, **case.kwargs)
    assert len(keys) == 1 and set(op._memo) == keys


def test_every_catalog_op_gets_its_custom_op_when_it_registers():
    loaded = []
    for op_id in OP_IDS:
        try:
            loaded.append(registry.get_op(op_id))
        except Exception:  # not there yet: covered by the skips above
            continue
    assert {op.id: library.build_errors()[op.id] for op in loaded if op.id in library.build_errors()} == {}
    for op in loaded:
        assert getattr(op, library._ATTR) is library._built[op.id].call


# ---------------------------------------------------------------------------------------------
# rms_norm: inductor, dynamic shapes, run-time selection, errors


def _rms_args(rows=6, n=32, dtype=torch.float32):
    x = torch.randn(rows, n, dtype=dtype, requires_grad=True)
    w = (1 + 0.1 * torch.randn(n)).to(dtype).requires_grad_()
    return Case(f"{rows}x{n}", (x, w), {"offset": 0.5})


@pytest.mark.slow  # Inductor on the CPU: C++ builds
def test_inductor_cpu_rms_norm_forward_backward():
    op = _op("norm.rms_norm")
    case = _rms_args()

    def model(x, w):  # inductor-generated code on both sides of the custom op
        return (polykernel.rms_norm(x * 2, w, offset=0.5) + 1).square()

    got = _run(torch.compile(model, fullgraph=True, backend="inductor"), case)
    want = _run(model, case)
    _assert_same(op, case, got, want, torch.float32, "rms_norm inductor")


def test_dynamic_shapes_do_not_recompile():
    op = _op("norm.rms_norm")
    compiled = torch.compile(lambda x, w: polykernel.rms_norm(x, w, offset=0.5), fullgraph=True, backend="aot_eager", dynamic=True)
    for i, (rows, n) in enumerate(((6, 32), (9, 48), (3, 17))):
        case = _rms_args(rows, n)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            got = _run(compiled, case)
        _assert_same(op, case, got, _run(lambda x, w: polykernel.rms_norm(x, w, offset=0.5), case), torch.float32, f"{rows}x{n}")


@pytest.fixture
def recorded_impl(monkeypatch):
    """A ``cuda_jit`` impl of rms_norm (rank 1000: never picked by auto) that records its calls.
    The registry tables are restored after the test."""
    op = _op("norm.rms_norm")
    monkeypatch.setitem(registry.REGISTRY._specs, op.id, dict(registry.specs_for(op)))
    monkeypatch.setattr(registry.REGISTRY, "_preloaded", dict(registry.REGISTRY._preloaded))
    calls = []

    def spy(x, weight, eps, offset, casting):
        calls.append(torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        return op.reference(x, weight, eps, offset, casting)

    polykernel.register_impl(op="rms_norm", backend="cuda_jit", rank=1000)(spy)
    yield calls
    dispatch.clear_caches()


def test_use_impl_and_set_impl_are_read_at_run_time(recorded_impl):
    calls = recorded_impl
    case = _rms_args()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lambda x, w: polykernel.rms_norm(x, w, offset=0.5), fullgraph=True, backend=counter)
    want = _run(lambda x, w: polykernel.rms_norm(x, w, offset=0.5, impl="torch"), case)

    _run(compiled, case)  # auto: the torch impl
    assert calls == []
    with polykernel.use_impl("cuda_jit"):
        got = _run(compiled, case)
    assert calls == [False, True]  # forward (no autograd inside the op), then the backward's recompute
    _assert_same(_op("norm.rms_norm"), case, got, want, torch.float32, "scoped cuda_jit")
    del calls[:]
    polykernel.set_impl("cuda_jit", op="rms_norm")
    _run(compiled, case)
    assert calls == [False, True]
    del calls[:]
    with polykernel.use_impl("torch"):  # a scope beats set_impl, inside compiled code too
        _run(compiled, case)
    assert calls == []
    polykernel.set_impl(None)
    _run(compiled, case)
    assert calls == []
    assert counter.frame_count == 1  # none of this recompiled: the choice is made at run time


def test_impl_argument_is_baked_into_the_graph(recorded_impl):
    calls = recorded_impl
    compiled = torch.compile(lambda x, w: polykernel.rms_norm(x, w, impl="cuda_jit"), fullgraph=True, backend="aot_eager")
    x, w = torch.randn(4, 8), torch.ones(8)
    torch.testing.assert_close(compiled(x, w), polykernel.rms_norm(x, w, impl="torch"))
    assert calls == [False]


def test_impl_preference_list_under_compile(recorded_impl):
    calls = recorded_impl
    x, w = torch.randn(4, 8), torch.ones(8)
    for impl in (["quack", "cuda_jit", "torch"], polykernel.KernelBackend.CUDA_JIT):
        torch._dynamo.reset()
        compiled = torch.compile(lambda x, w, impl=impl: polykernel.rms_norm(x, w, impl=impl), fullgraph=True, backend="aot_eager")
        torch.testing.assert_close(compiled(x, w), polykernel.rms_norm(x, w, impl="torch"))
    assert calls == [False, False]


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("eager_first", [False, True])
def test_export_keeps_the_custom_op(strict, eager_first):
    # eager_first: the hot path holds a guard record for these very tensors when export starts;
    # non-strict export runs the Python (no Dynamo) on fake tensors, which the guard refuses, and
    # the slow path sends the call to the custom op (hot_path._TRACING_EXPR)
    op = _op("norm.rms_norm")
    _, fwd, _ = _overloads(op)

    class Norm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(16))

        def forward(self, x):
            return polykernel.rms_norm(x, self.weight, casting="llama")

    model, x = Norm(), torch.randn(3, 16)
    if eager_first:
        model(x)
        with torch.no_grad():
            model(x)
    program = torch.export.export(model, (x,), strict=strict)
    # The weight requires grad, so the training op (forward + saved tensors) is what is exported.
    assert {fwd, library._built[op.id].train} & _targets(program.graph_module)
    torch.testing.assert_close(program.module()(x), model(x))


def test_eager_calls_do_not_use_the_custom_op(monkeypatch):
    _op("norm.rms_norm")

    def boom(op):
        raise AssertionError("went through the custom op")

    monkeypatch.setattr(library, "custom_op_for", boom)
    x = torch.randn(4, 8, requires_grad=True)
    polykernel.rms_norm(x, torch.ones(8)).sum().backward()  # eager, forward and backward: fine
    with pytest.raises(Exception, match="went through the custom op"):  # the compiled path does use it
        torch.compile(lambda x: polykernel.rms_norm(x, torch.ones(8)), fullgraph=True, backend="eager")(x)


def test_bad_arguments_raise_the_ops_error_under_compile():
    _op("norm.rms_norm")
    x, w = torch.randn(4, 8), torch.ones(7)
    with pytest.raises(OpArgumentError, match=r"norm\.rms_norm.*'weight'"):  # graph break, then eager raises
        torch.compile(lambda x, w: polykernel.rms_norm(x, w), backend="eager")(x, w)
    torch._dynamo.reset()
    # fullgraph: Dynamo cannot build the exception inside the graph, so it reports an unsupported
    # construct (torch.compile's own error type), at compile time, before anything runs.
    with pytest.raises(Exception, match="rms_norm"):
        torch.compile(lambda x, w: polykernel.rms_norm(x, w), fullgraph=True, backend="eager")(x, w)


def _user_reference(
    x: torch.Tensor, y: torch.Tensor | None = None, alpha: float = 2.0, mode: str = "sum"
) -> tuple[torch.Tensor, torch.Tensor]:
    out = x * alpha + (y if y is not None else 0)
    return out, (out.sum(-1) if mode == "sum" else out.amax(-1))


def _user_impl(x, y, alpha, mode):
    return _user_reference(x, y, alpha, mode)


@pytest.mark.slow  # Inductor compiles of a whole new op
def test_user_defined_op_compiles(monkeypatch):
    """An op made outside the catalog gets its custom op when it registers (options with
    defaults, an optional tensor, a tuple output), and compiles like the built-in ones."""
    from polykernel.core.op import Bounds, ErrorModel
    from polykernel.spec import KernelSpec

    monkeypatch.setattr(registry.REGISTRY, "_ops", dict(registry.REGISTRY._ops))
    monkeypatch.setattr(registry.REGISTRY, "_specs", dict(registry.REGISTRY._specs))
    op = Op(
        "test.pk_compile_user_op",
        fields=("device", "dtype", "needs_grad"),
        key=lambda x, y=None, alpha=2.0, mode="sum": (x.device, x.dtype, torch.is_grad_enabled() and x.requires_grad),
        default_key=lambda device, dtype: (device, dtype, False),
        reference=_user_reference,
        error_model=lambda *a, **k: Bounds(outputs=(ErrorModel(),), grads={0: ErrorModel(), 1: ErrorModel()}),
        dtypes=(torch.float32,),
        cases=lambda device, dtype, large=False: [],
        example=lambda *a, **k: None,
        impls=[KernelSpec("test.pk_compile_user_op", "torch", f"{__name__}:_user_impl")],
    )
    _, fwd, _ = _overloads(op)
    assert str(fwd._schema).endswith('(Tensor x, Tensor? y=None, float alpha=2., str mode="sum", *, str? impl=None) -> (Tensor, Tensor)')

    def public(x, y=None, alpha=2.0, mode="sum"):
        return op.call(None, op.key(x, y, alpha, mode), x, y, alpha, mode)

    for y in (None, torch.randn(3, 5, requires_grad=True)):
        case = Case("3x5", (torch.randn(3, 5, requires_grad=True), y), {"alpha": 0.5, "mode": "max"})
        compiled = torch.compile(lambda x, y: public(x, y, alpha=0.5, mode="max"), fullgraph=True, backend="aot_eager")
        got, want = _run(compiled, case), _run(lambda x, y: _user_reference(x, y, 0.5, "max"), case)
        _assert_same(op, case, got, want, torch.float32, f"user op, y={'tensor' if y is not None else None}")
        torch.library.opcheck(fwd, case.args, case.kwargs)


def test_fresh_outputs_never_alias_inputs():
    x = torch.randn(4, 6)
    y = torch.randn(6, 4).t()
    out = library._fresh([x, x[:, ::2], y, y], [x])
    assert all(o.is_contiguous() for o in out)
    ids = [o.untyped_storage()._cdata for o in out]
    assert x.untyped_storage()._cdata not in ids and len(set(ids)) == 4
    torch.testing.assert_close(out[1], x[:, ::2])
    torch.testing.assert_close(out[3], y)


# ---------------------------------------------------------------------------------------------
# Training under compile: one forward per op call, the backward on the saved tensors


def _real(a) -> bool:
    """A real tensor (not a fake one seen while tracing)."""
    return type(a) is torch.Tensor or type(a) is torch.nn.Parameter


def _counted_split(monkeypatch, fn, log: list):
    """Replace ``fn.split`` by one that logs its real (not traced) forward and backward calls."""
    split = fn.split

    def forward(*args):
        if _real(args[0]):
            log.append("forward")
        return split.forward(*args)

    def backward(grads, saved, *args):
        log.append("backward")
        return split.backward(grads, saved, *args)

    monkeypatch.setattr(fn, "split", Split(forward, backward, split.layout))


def _two_norms(x, w1, w2):
    return polykernel.rms_norm(polykernel.rms_norm(x, w1, casting="llama") * 3, w2, offset=0.5)


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_compiled_training_runs_each_forward_once(monkeypatch, impl):
    op = _op("norm.rms_norm")
    fn = registry.load_impl(registry.specs_for(op)[impl])
    log: list = []
    _counted_split(monkeypatch, fn, log)
    launches: list = []
    if impl == "triton":  # the kernel's host launcher, module global of the split's forward
        module = importlib.import_module("polykernel.backends.triton.rms_norm")
        launcher = module.rms_norm_forward
        monkeypatch.setattr(module, "rms_norm_forward", lambda *a: launches.append(1) or launcher(*a))
    case = Case("5x24", (torch.randn(5, 24, requires_grad=True), *(torch.randn(24).requires_grad_() for _ in range(2))))
    compiled = torch.compile(lambda *a: _scoped(impl, *a), fullgraph=True, backend="aot_eager")
    got = _run(compiled, case)
    assert log == ["forward", "forward", "backward", "backward"]  # no recompute in the backward
    if impl == "triton":
        assert len(launches) == 2
    with polykernel.use_impl("torch"):
        want = _run(_two_norms, case)
    for g, w in zip([*got[0], *got[1]], [*want[0], *want[1]]):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def _scoped(impl, *args):
    return polykernel.rms_norm(polykernel.rms_norm(args[0], args[1], casting="llama", impl=impl) * 3, args[2], offset=0.5, impl=impl)


# Per op with a split: a model that calls it twice (the second call on the first's output, so
# the backward runs both splits' backwards) and a small case whose floating tensors need grads.
def _ln_twice(impl, x, w, b):
    return polykernel.layer_norm(polykernel.layer_norm(x, w, b, impl=impl) * 3, None, b, eps=1e-3, impl=impl)


def _ln_case():
    return Case("5x24", (torch.randn(5, 24, requires_grad=True), *(torch.randn(24).requires_grad_() for _ in range(2))))


def _ce_twice(impl, x, t):
    first = polykernel.cross_entropy(x, t, impl=impl)
    return first + polykernel.cross_entropy(x * 2, t, label_smoothing=0.1, reduction="none", impl=impl).square().sum()


def _ce_case():
    target = torch.randint(0, 40, (2, 3))
    target[0, 1] = -100
    return Case("6x40", (torch.randn(2, 3, 40, requires_grad=True), target))


def _softmax_twice(impl, x):
    return polykernel.softmax(polykernel.softmax(x, impl=impl) * 5, impl=impl)


def _softmax_case():
    return Case("5x24", (torch.randn(5, 24, requires_grad=True),))


_TWICE = {
    "norm.layer_norm": (_ln_twice, _ln_case),
    "loss.cross_entropy": (_ce_twice, _ce_case),
    "activation.softmax": (_softmax_twice, _softmax_case),
}


@pytest.mark.slow  # Inductor compiles of a training step, per op and impl
@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("op_id", list(_TWICE))
def test_compiled_training_runs_each_split_forward_once(monkeypatch, op_id, impl):
    """One forward per call in a compiled fwd+bwd (the backward uses the saved tensors, no
    recompute) and the gradients of an eager run with the torch impl."""
    op = _op(op_id)
    fn = registry.load_impl(registry.specs_for(op)[impl])
    log: list = []
    _counted_split(monkeypatch, fn, log)
    twice, make_case = _TWICE[op_id]
    case = make_case()
    compiled = torch.compile(lambda *a: twice(impl, *a), fullgraph=True, backend="aot_eager")
    got = _run(compiled, case)
    assert log == ["forward", "forward", "backward", "backward"]  # no recompute in the backward
    want = _run(lambda *a: twice("torch", *a), case)
    assert len(got[1]) == len(want[1]) == sum(isinstance(a, torch.Tensor) and a.requires_grad for a in case.args)
    for g, w in zip([*got[0], *got[1]], [*want[0], *want[1]]):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_compiled_linear_cross_entropy_walks_the_chunks_once(monkeypatch):
    """The fused linear cross-entropy computes its gradients in the forward walk: compiled, the
    backward only scales them (the recompute path walked twice)."""
    _op("loss.fused_linear_cross_entropy")
    module = importlib.import_module("polykernel.backends._fused_linear_cross_entropy")
    walk, walks = module._walk, []
    monkeypatch.setattr(module, "_walk", lambda *a, **k: walks.append(type(a[0])) or walk(*a, **k))
    h, w = torch.randn(2, 3, 16, requires_grad=True), torch.randn(40, 16, requires_grad=True)
    target = torch.randint(0, 40, (2, 3))
    target[0, 0] = -100
    case = Case("6x16x40", (h, w, target))
    for reduction, expected in (("mean", 1), ("sum", 1), ("none", 2)):
        torch._dynamo.reset()
        walks.clear()
        compiled = torch.compile(
            lambda h, w, t, r=reduction: polykernel.fused_linear_cross_entropy(h, w, t, reduction=r), fullgraph=True, backend="aot_eager"
        )
        got = _run(compiled, case)
        assert sum(t is torch.Tensor for t in walks) == expected, (reduction, walks)
        want = _run(lambda h, w, t, r=reduction: polykernel.fused_linear_cross_entropy(h, w, t, reduction=r), case)
        for g, e in zip([*got[0], *got[1]], [*want[0], *want[1]]):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


def _linear_ce_case(dtype=torch.float32, bias=False):
    h = torch.randn(2, 24, 16, dtype=dtype, requires_grad=True)
    w = (0.5 * torch.randn(40, 16)).to(dtype).requires_grad_()
    target = torch.randint(0, 40, (2, 24))
    target[0, :3] = -100
    b = (0.1 * torch.randn(40)).to(dtype).requires_grad_() if bias else None
    return h, w, target, b


_FLCE_BACKWARD = "fused_linear_cross_entropy_train_backward"


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_compiled_linear_cross_entropy_backward_is_a_traced_scale(reduction):
    """With "mean"/"sum" the forward saves the gradients for grad_output = 1: the compiled backward
    graph multiplies the saved tensors by grad_output itself (so that Inductor can do it in their
    buffers), with no backward custom op; with "none" the backward custom op walks again."""
    _op("loss.fused_linear_cross_entropy")
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def bw_compiler(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm.forward), bw_compiler=bw_compiler)
    h, w, target, b = _linear_ce_case(bias=True)

    def loss(h, w, t, b):
        return polykernel.fused_linear_cross_entropy(h, w, t, b, reduction=reduction)

    case = Case("2x24x16x40", (h, w, target, b))
    got = _run(torch.compile(loss, fullgraph=True, backend=backend), case)
    (bw,) = graphs
    nodes = [n for n in bw.graph.nodes if n.op == "call_function"]
    custom = [n for n in nodes if _FLCE_BACKWARD in str(n.target)]
    if reduction == "none":
        assert len(custom) == 1
    else:
        assert custom == []
        scaled = [n for n in nodes if n.target is torch.ops.aten.mul.Tensor and n.args[0].op == "placeholder"]
        assert sorted(tuple(n.meta["val"].shape) for n in scaled) == sorted([(40,), (40, 16), (2, 24, 16)])
    want = _run(loss, case)  # eager: the impl's own autograd (scales in place, skips g == 1)
    assert len(got[1]) == len(want[1]) == 3
    for g, e in zip([*got[0], *got[1]], [*want[0], *want[1]]):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_inductor_linear_cross_entropy_scales_saved_gradients_in_place(reduction):
    """Issue 14: Inductor writes grad_output x the forward's saved grad_hidden and grad_weight into
    the saved buffers themselves (donated buffers), so no second grad_weight ([V, H]) is ever
    alive with the first, as in eager. The backward custom op had to return fresh tensors."""
    _op("loss.fused_linear_cross_entropy")
    h, w, target, b = _linear_ce_case(torch.bfloat16, bias=True)

    def loss(h, w, t, b):
        return polykernel.fused_linear_cross_entropy(h, w, t, b, reduction=reduction)

    compiled = torch.compile(loss, fullgraph=True, backend="inductor")
    saved, grads = {}, {}

    def pack(t):
        saved[t.data_ptr()] = tuple(t.shape)
        return t

    args = [fresh(a) for a in (h, w, target, b)]
    for name, a in zip(("hidden", "weight", "bias"), (args[0], args[1], args[3])):
        a.register_hook(lambda g, name=name: grads.__setitem__(name, g.data_ptr()))
    with torch._inductor.config.patch(force_disable_caches=True):  # the graphs are built here, not loaded
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = compiled(*args)
        (3.0 * out).backward()  # AOTAutograd may compile the backward only now
    assert saved.get(grads["hidden"]) == (2, 24, 16)
    assert saved.get(grads["weight"]) == (40, 16)
    want_args = [fresh(a) for a in (h, w, target, b)]
    (3.0 * loss(*want_args)).backward()
    torch.testing.assert_close(out, loss(*want_args).detach(), rtol=1e-5, atol=1e-5)
    for a, e in zip((args[0], args[1], args[3]), (want_args[0], want_args[1], want_args[3])):
        torch.testing.assert_close(a.grad, e.grad, rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("op_id", ["norm.rms_norm", "loss.fused_linear_cross_entropy", *_TWICE])
def test_every_split_saves_the_ops_layout(op_id):
    """The backward may select another impl than the forward did: every impl's split must save
    what the torch impl's split saves (shapes, dtypes and values)."""
    op = _op(op_id)
    layout = library._layout_split(op)
    assert layout is not None
    for case in _small_cases(op, n=3):
        bound = inspect.signature(op.reference).bind(*case.args, **case.kwargs)
        bound.apply_defaults()
        args = [a.detach() if isinstance(a, torch.Tensor) else a for a in bound.arguments.values()]
        mask = [isinstance(a, torch.Tensor) and a.is_floating_point() for a in args]
        _, want = layout.forward(*args, mask)
        if layout.layout is not None:
            assert [(t.shape, t.dtype) for t in layout.layout(*args, mask)] == [(t.shape, t.dtype) for t in want]
        for name, spec in registry.specs_for(op).items():
            try:
                split = getattr(registry.load_impl(spec), "split", None)
            except Exception:  # not importable here
                continue
            if split is None or not polykernel.available_impls(op_id, device="cpu").count(name):
                continue
            _, got = split.forward(*args, mask)
            assert [(t.shape, t.dtype) for t in got] == [(t.shape, t.dtype) for t in want], (name, case.label)
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_backward_after_a_scope_ends_uses_the_saved_layout(recorded_impl):
    """Forward under ``use_impl`` (an impl without a split: the saved tensors come from the torch
    impl's split), backward outside it (the auto impl's backward on them): still correct."""
    calls = recorded_impl
    case = _rms_args()
    compiled = torch.compile(lambda x, w: polykernel.rms_norm(x, w, offset=0.5), fullgraph=True, backend="aot_eager")
    args = [fresh(a) for a in case.args]
    with polykernel.use_impl("cuda_jit"):
        y = compiled(*args)
    assert calls == [False]
    cot = torch.randn_like(y)
    got = torch.autograd.grad(y, args, cot)
    assert calls == [False]  # the backward ran the auto impl's split, not a recompute of cuda_jit
    want_args = [fresh(a) for a in case.args]
    want = torch.autograd.grad(polykernel.rms_norm(*want_args, offset=0.5, impl="torch"), want_args, cot)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_decomposed_ops_trace_the_reference_unless_an_impl_is_forced():
    op = _op("activation.swiglu")
    compiled_op = library._built[op.id]
    assert compiled_op.mode == "decompose"
    gate, up = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
    for impl, expected in ((None, None), ("torch", compiled_op.train)):
        torch._dynamo.reset()
        counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
        torch.compile(lambda g, u, i=impl: polykernel.swiglu(g, u, impl=i), fullgraph=True, backend=counter)(gate, up)
        targets = _targets(counter.graphs[0])
        if expected is None:
            assert not any(str(t).startswith("polykernel.") for t in targets), targets
        else:
            assert expected in targets


# ---------------------------------------------------------------------------------------------
# GPU (the lead runs these on the H200): inductor on CUDA for every op, forward and backward


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("op_id", OP_IDS)
def test_inductor_cuda(op_id, dtype):
    op = _op(op_id)
    if dtype not in op.dtypes:
        pytest.skip(f"{op_id} has no {dtype} cases")
    _overloads(op)  # built
    cases = _small_cases(op, "cuda", dtype, n=2)
    small_labels = {c.label for c in op.cases("cuda", dtype)}
    large = [c for c in op.cases("cuda", dtype, large=True) if c.label not in small_labels][:1]
    for case in cases + large:
        torch._dynamo.reset()
        counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
        got = _run(_compiled(op, case, counter), case)
        # Against the reference (the parity contract): the compiled forward selects with
        # needs_grad=False, so it may run another impl than an eager call with grad would.
        want = _run(lambda *a, case=case: op.reference(*a, **case.kwargs), case)
        _assert_same(op, case, got, want, dtype, f"{op_id} {case.label} {dtype} inductor")
        node = _expected_node(op, case)
        assert node is None or any(node in _targets(g) for g in counter.graphs)
        del got, want
    del large


# ---------------------------------------------------------------------------------------------
# compile_mode "eager" (the fused preference/RL losses): a graph break around the eager dispatcher


def test_eager_mode_breaks_the_graph_and_matches_eager():
    op = _op("loss.fused_linear_dpo_loss")
    assert library._built[op.id].mode == "eager"
    case = _small_cases(op)[-1]
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    public, kwargs = _public(op), dict(case.kwargs)

    def fn(*args):
        out = public(*args, **kwargs)
        return out.loss * 2, out.chosen_logps + 1  # traced code on both sides of the break

    got = _run(torch.compile(fn, backend=counter), case)
    want = _run(fn, case)
    for g, w in zip(got[0] + got[1], want[0] + want[1]):
        torch.testing.assert_close(g, w, equal_nan=True)  # one impl, one order of sums: the same values
    assert got[1] and counter.frame_count >= 1
    assert not any(str(t).startswith("polykernel.") for g in counter.graphs for t in _targets(g))  # nothing opaque traced


def test_eager_mode_under_fullgraph_is_a_clear_graph_break():
    op = _op("loss.fused_linear_grpo_loss")
    case = _small_cases(op)[0]
    public, kwargs = _public(op), dict(case.kwargs)
    compiled = torch.compile(lambda *a: public(*a, **kwargs).loss, fullgraph=True, backend="aot_eager")
    with pytest.raises(torch._dynamo.exc.Unsupported, match=r"(?i)skip|disable"):
        compiled(*[fresh(a) for a in case.args])


def test_eager_mode_still_checks_the_token_ids():
    # the trace skips the data-dependent check; the eager call behind the break makes it
    op = _op("loss.fused_linear_dpo_loss")
    h, w, t = (fresh(a) for a in _small_cases(op)[0].args[:3])
    bad = t.clone()
    bad[0, 0] = w.shape[0]
    compiled = torch.compile(lambda *a: _public(op)(*a).loss, backend="aot_eager")
    compiled(h, w, t)
    with pytest.raises(OpArgumentError, match="target"):
        compiled(h, w, bad)


def test_eager_is_an_ops_own_fact_not_a_variables_choice(monkeypatch):
    op = _op("activation.swiglu")
    monkeypatch.setenv("POLYKERNEL_COMPILE_SWIGLU", "eager")
    with pytest.raises(ValueError, match="POLYKERNEL_COMPILE_SWIGLU: 'eager' is not 'ours' or 'decompose'"):
        library._compile_mode(op, "swiglu")
