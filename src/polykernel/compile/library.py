"""``torch.compile`` integration: every op as a ``torch.library`` custom op ``polykernel::<name>``.

Under ``torch.compile`` (and ``torch.export``) :meth:`Op.call <polykernel.core.op.Op.call>` does not
dispatch in Python: it calls the op's custom op, which Dynamo puts in the graph as one opaque
node, so ``fullgraph=True`` works with every backend. Eager calls never come here.

For each op (built once, when the op registers or when this module is first imported) there are
two custom ops, with schemas derived from the op's ``reference`` signature::

    polykernel::rms_norm(Tensor x, Tensor weight, float eps=1e-06, float offset=0.0,
                         str casting="fp32", *, str? impl=None) -> Tensor
    polykernel::rms_norm_backward(Tensor?[] grad_outputs, Tensor x, Tensor weight, float eps,
                                  float offset, str casting, bool[] grad_mask, *,
                                  str? impl=None) -> Tensor[]

- **Real impl** (the forward): the dispatcher's eager path, run at *run time* under ``no_grad``:
  selection reads the same mutable state as an eager call (``impl=``, ``use_impl`` scopes,
  ``POLYKERNEL_IMPL*``, ``set_impl``, tuning, the runtime-fault policy), so compiled code keeps
  honouring them without recompiling. Outputs are made fresh (never an input or a view of one)
  and contiguous, matching the fake impl's layout exactly (inductor asserts the strides).
- **Fake impl**: the op's ``reference`` run on the fake tensors, for shapes and dtypes only, then
  ``torch.empty`` of those (contiguous, fresh). The reference must therefore be pure torch with
  no data-dependent output shape.
- **Autograd** of ``polykernel::<name>``: ``setup_context`` saves the inputs; the backward is
  the second custom op, whose real impl recomputes the forward with the impl the dispatcher
  selects, under ``enable_grad``, and returns ``torch.autograd.grad`` of it.

**Training without recompute.** When an input needs a gradient, a compiled call uses a third and
fourth custom op instead, with fixed-arity returns (one per output, saved tensor and gradient,
so that DTensor's ``register_sharding`` can give each a placement)::

    polykernel::rms_norm_train(Tensor x, ..., bool[] grad_mask, *, str? impl=None) -> (Tensor, Tensor)
    polykernel::rms_norm_train_backward(Tensor? grad_output_0, Tensor saved_0, Tensor x, ...,
                                        bool[] grad_mask, *, str? impl=None) -> (Tensor, Tensor)

The forward selects (at run time, with ``needs_grad`` in the key, as an eager training call
does) and, if the impl carries a :class:`~polykernel.spec.Split`, runs its ``forward``, which
returns the outputs and the tensors its backward needs (``saved``, a fixed set per op: the
op's ``saved``, :mod:`polykernel.compile.facts`). The backward selects again (same state, same impl) and runs the split's
``backward`` on ``saved``: each forward kernel runs once per step. It returns one tensor per
tensor argument: the gradient where ``grad_mask`` asks for one, else an empty placeholder
(shape ``(0,) * ndim``, so that any placement of the argument is valid for it).
``saved`` has one layout per op (the torch impl's split defines it), so a backward that selects
another impl than its forward (a ``use_impl`` scope that ended in between) is still right; an
impl without a split (peers) runs its forward plainly, ``saved`` then comes from the torch
split, and its backward recomputes as above. On DTensors the training ops run on the local
shards through the sharding rules of :mod:`polykernel.compile.sharding`; an op or a call those
rules do not cover decomposes into torch ops (logged once). Where the saved tensors are the
gradients themselves, for a unit grad_output (the op's ``saved_grads``: the fused linear
cross-entropy's "mean"/"sum"), the autograd formula multiplies them in the graph instead of
calling the backward custom op, so that Inductor scales them in their own buffers.

**Ops that write into given tensors** (``Op.writes``: the serving ops' ``out=``, in-place
arguments, fp8 outputs) get one custom op instead, ``polykernel::silu_and_mul(Tensor x,
Tensor(a!)? out=None, *, str? impl=None) -> ()``: the written arguments are marked mutable, the
real impl dispatches under ``no_grad`` (the impl writes the destinations), the fake impl writes
nothing, and the compiled call returns the destinations as the eager call does. No autograd, no
training ops: those ops are inference only.

**Per-op choice** (the op's ``compile_mode``, measured; ``POLYKERNEL_COMPILE_<OP>=ours|decompose``):
ops where Inductor's own code is as fast as ours (swiglu, geglu, rope, fused_add_rms_norm)
*decompose*: without ``impl=``, Dynamo traces the op's torch reference, so Inductor fuses it
with its neighbours and the dispatcher is not involved. ``impl=`` still forces our impl.

**Not done: ``torch.library.triton_op``.** Inductor can only see a Triton kernel whose launch it
traces, i.e. with the impl chosen at trace time. Here selection happens at run time inside the
custom op (scopes, ``set_impl`` and the fault policy keep working in compiled code without a
recompile; ``reduce-overhead`` graphs replay what was recorded). Switching compiled graphs to
trace-time selection (guarded on the dispatcher's state) is the step that would allow it.
"""

from __future__ import annotations

import inspect
import math
import os
import sys
import threading
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import _compat
from ..core import registry
from ..core.op import Op
from ..errors import OpArgumentError
from ..spec import KernelBackend, Split
from .facts import MODES, SavedGrads

__all__ = ["NAMESPACE", "CompiledOp", "SavedGrads", "build_errors", "custom_op_for"]

NAMESPACE = "polykernel"

_lock = threading.RLock()
_built: dict[str, CompiledOp] = {}  # op id -> its custom ops (filled once per op, never replaced)
_errors: dict[str, str] = {}  # op id -> why its custom op could not be built
_taken: dict[str, str] = {}  # custom-op name -> op id
_ATTR = "_polykernel_custom_op"  # set on each Op object: its CompiledOp.call


# Ops whose saved tensors are, for some calls, the gradients for a unit scalar grad_output
# (``Op.saved_grads``: the fused linear cross-entropy with reduction "mean"/"sum"): their compiled
# backward is ``saved * grad_output``, traced into the graph by the autograd formula instead of run
# inside the opaque backward custom op. Inductor then sees a pointwise multiply whose input, a
# saved tensor aliased to nothing else, is a donated buffer (torch._functorch.config.donated_buffer,
# on by default) at its last use, and writes the product into that buffer, as eager scales in
# place. Inside the custom op the product had to be a fresh tensor (custom-op outputs never alias
# inputs): a second grad_weight ([V, H], 0.5 GiB at Llama 3's 128K vocab and H = 2048) alive with
# the first at the start of the backward, the step's peak (issue 14). The multiply always runs
# (eager skips it at grad_output == 1, which needs a host sync: none in compiled code, so CUDA
# graphs capture it). DTensors keep the custom op (its sharding rules place the gradients);
# backends without Inductor (aot_eager) multiply out of place. Read while tracing: setting the
# op's saved_grads to None brings the custom op back for the next compile.


def _has_dtensor(args: Sequence[Any]) -> bool:
    """Whether any argument is a DTensor (only looked up if torch.distributed.tensor is loaded)."""
    mod = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(mod, "DTensor", None)
    return dtensor is not None and any(isinstance(a, dtensor) for a in args)


def _register_rules(op_id: str) -> None:
    """Register ``op_id``'s DTensor sharding rules (idempotent): a compiled call met a DTensor."""
    # polykernel.distributed.dtensor too: a DTensor is in use, so eager calls take its route, and the
    # traced mean_of_sum reads it (a first import is not possible while Dynamo traces).
    from ..distributed import dtensor  # noqa: F401
    from . import sharding as dtensor_sharding

    dtensor_sharding.register(_current(op_id), _built[op_id])


def _report_decomposing(op_id: str, why: str) -> None:
    """Compiled training on DTensors decomposes ``op_id``: logged once; ``POLYKERNEL_STRICT=1``
    makes it an error."""
    from ..core import selection as dispatch
    from ..errors import ImplNotAvailableError

    if dispatch.strict_mode():
        raise ImplNotAvailableError(op_id, "training custom ops on DTensors", f"{why} (POLYKERNEL_STRICT=1)")
    dispatch.log_once(("compile-dtensor", op_id, why), f"polykernel: {op_id}: compiled training on DTensors decomposes the op ({why})")


# Side effects of a compiled call that must really happen while Dynamo traces CompiledOp.call
# (registering rules, logging: a logger call in traced code would break the graph, and
# fullgraph=True with it). They run through ``comptime``, whose function Dynamo runs; by name,
# with string arguments, so that the rule reads only constants.
_TRACE_TIME = {"register_rules": _register_rules, "report_decomposing": _report_decomposing}


def _at_trace_time(action: str, *args: str) -> None:
    """``_TRACE_TIME[action](*args)``, now: also while Dynamo traces the caller."""
    if torch.compiler.is_compiling():
        comptime = _compat.comptime()
        if comptime is not None:
            comptime(_from_trace)
        else:  # no comptime in this torch: the fake impl of a no-op custom op, run while tracing
            _trace_time_op(action, list(args))
    else:
        _TRACE_TIME[action](*args)


def _from_trace(ctx: Any) -> None:  # no free variables: comptime's rule
    _TRACE_TIME[ctx.get_local("action").as_python_constant()](*ctx.get_local("args").as_python_constant())


def _trace_time_real(action: str, args: list[str]) -> None:
    """The compiled graph's node does nothing when it runs: the action ran while tracing."""


_trace_time_op = torch.library.custom_op(
    f"{NAMESPACE}::trace_time_action", _trace_time_real, mutates_args=(), schema="(str action, str[] args) -> ()"
)
_trace_time_op.register_fake(lambda action, args: _TRACE_TIME[action](*args))


def custom_op_for(op: Op | str) -> Callable[..., Any]:
    """``callable(impl, *args)`` that runs ``op`` through its ``polykernel::<name>`` custom op.

    ``args`` are the impl's positional arguments (the public function's minus ``impl=``).
    Built once per op and cached; safe to call from several threads. This lookup is what Dynamo
    traces on the compiled path, so its hit path is a plain dict read.
    """
    if not isinstance(op, str):
        # Dynamo traces this: an attribute of the op object is read live, while a global dict
        # read once in a trace is a snapshot (an op registered later in the same trace would be
        # missing from it).
        call = getattr(op, _ATTR, None)
        if call is not None:
            return call
    op_id = op if isinstance(op, str) else op.id
    hit = _built.get(op_id)
    if hit is None:
        the_op = registry.get_op(op_id)
        if the_op.id in _errors:
            raise RuntimeError(f"polykernel: {the_op.id}: cannot build its torch.library custom op: {_errors[the_op.id]}")
        hit = _build(the_op)
    return hit.call


def built() -> dict[str, CompiledOp]:
    """Op id -> its custom ops, for the ops built so far."""
    return dict(_built)


def build_errors() -> dict[str, str]:
    """Ops whose custom op could not be built (op id -> error). Empty when all is well."""
    return dict(_errors)


# ---------------------------------------------------------------------------------------------
# Schema from the reference's signature

_SCALARS: dict[Any, str] = {
    torch.Tensor: "Tensor",
    float: "float",
    int: "SymInt",  # SymInt, so an int argument Dynamo makes dynamic still fits
    bool: "bool",
    str: "str",
    torch.dtype: "ScalarType",
    torch.device: "Device",
}
_LISTS = (list, tuple, Sequence)


def _schema_type(tp: Any, where: str) -> str:
    """A Python annotation -> a schema type (``Tensor``, ``Tensor?``, ``float``, ``SymInt[]``...)."""
    if tp in _SCALARS:
        return _SCALARS[tp]
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            inner = _schema_type(rest[0], where)
            if not inner.endswith("?"):
                return inner + "?"
    if origin in _LISTS or (isinstance(origin, type) and issubclass(origin, Sequence)):
        elems = [a for a in args if a is not Ellipsis]
        if len(set(elems)) == 1:
            return _schema_type(elems[0], where) + "[]"
    raise TypeError(f"polykernel: {where}: annotation {tp!r} has no torch.library schema type")


def _return_types(tp: Any, where: str) -> list[str]:
    """The reference's return annotation -> schema return types (a list of ``Tensor`` usually)."""
    if tp is inspect.Signature.empty or tp is None:
        return ["Tensor"]
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is tuple and args and Ellipsis not in args:
        return [_schema_type(a, where) for a in args]
    return [_schema_type(tp, where)]


def _default(value: Any) -> str | None:
    """A schema default literal, or None when the value has none (the argument is then required)."""
    if value is None:
        return "None"
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value) if value == value and value not in (float("inf"), float("-inf")) else None
    if isinstance(value, str) and '"' not in value and "\\" not in value:
        return f'"{value}"'
    return None


class _Param(typing.NamedTuple):
    name: str
    type: str  # schema type
    default: str | None  # schema literal
    value: Any  # the Python default (inspect.Parameter.empty when none)


def _params(op: Op) -> tuple[list[_Param], list[str]]:
    """The impl's parameters (from the reference) and the return types, as schema pieces."""
    ref = op.reference
    sig = inspect.signature(ref)
    try:
        hints = typing.get_type_hints(ref)
    except Exception:  # unresolvable string annotations: fall back per parameter
        hints = {}
    params = []
    for p in sig.parameters.values():
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            raise TypeError(f"polykernel: {op.id}: reference parameter {p.name!r} must be positional (it is {p.kind.description})")
        if p.name in ("impl", "grad_outputs", "grad_mask") or p.name.startswith(("grad_output_", "saved_")):
            raise TypeError(f"polykernel: {op.id}: reference parameter name {p.name!r} is reserved")
        tp = hints.get(p.name)
        if tp is None:  # unannotated: the default's type, else a tensor
            tp = type(p.default) if p.default is not p.empty and p.default is not None else torch.Tensor
        default = _default(p.default) if p.default is not p.empty else None
        params.append(_Param(p.name, _schema_type(tp, f"{op.id} parameter {p.name!r}"), default, p.default))
    returns = _return_types(hints.get("return", inspect.Signature.empty), f"{op.id} return")
    return params, returns


def _schema(params: Sequence[_Param], returns: Sequence[str], *, with_defaults: bool, prefix: str = "", suffix: str = "") -> str:
    parts = [prefix] if prefix else []
    for p in params:
        parts.append(f"{p.type} {p.name}" + (f"={p.default}" if with_defaults and p.default is not None else ""))
    if suffix:
        parts.append(suffix)
    parts.append("*, str? impl=None")
    ret = returns[0] if len(returns) == 1 else f"({', '.join(returns)})"
    return f"({', '.join(parts)}) -> {ret}"


# ---------------------------------------------------------------------------------------------
# The run-time bodies


def _select_and_run(op: Op, impl: str | None, args: Sequence[Any], names: Sequence[str] | None) -> Any:
    """The dispatcher's eager path (:meth:`Op.run`: ``Op.call`` minus its compile check, which
    would re-enter the custom op while a compile is in progress). ``names``: pass the arguments
    to ``op.key`` by name (its signature is the public function's, with keyword-only options)."""
    argkey = op.key(**dict(zip(names, args))) if names is not None else op.key(*args)
    return op.run(impl, argkey, *args)


def _training_decision(op: Op, impl: str | None, args: Sequence[Any], names: Sequence[str] | None) -> Any:
    """The dispatcher's decision for a training call (``needs_grad`` True), without running it:
    the forward and the backward of a compiled graph both ask this, so that with unchanged
    state they pick the same impl (the key mirrors :meth:`Op.run`'s, with needs_grad set)."""
    args = tuple(args)
    argkey = op.key(**dict(zip(names, args))) if names is not None else op.key(*args)
    argkey = (*argkey[:2], True, *argkey[3:])  # fields start (device, dtype, needs_grad)
    return op.decision_for(impl, argkey, args)


def _valid(op: Op, args: Sequence[Any]) -> bool:
    """Whether ``args`` pass the op's validation (True for an op without one)."""
    if op.validate is None:
        return True
    try:
        op.validate(*args)
    except OpArgumentError:
        return False
    return True


def _split_of(fn: Any) -> Split | None:
    split = getattr(fn, "split", None)
    return split if isinstance(split, Split) else None


def _layout_split(op: Op) -> Split | None:
    """The split that defines the op's saved layout: the torch impl's (None: nothing is saved)."""
    spec = registry.specs_for(op).get("torch")
    if spec is None:
        return None
    try:
        return _split_of(registry.load_impl(spec))
    except Exception:  # the torch impl always imports; if not, the op saves nothing
        return None


def _key_names(op: Op, names: Sequence[str]) -> tuple[str, ...] | None:
    """The parameter names to call ``op.key`` with by keyword, or None to call it positionally."""
    try:
        inspect.signature(op.key).bind(**dict.fromkeys(names))
        return tuple(names)
    except TypeError:
        return None


def _impl_str(impl: Any) -> str:
    """``impl=`` as the schema's ``str``: a preference list becomes ``"a,b"`` (the dispatcher
    parses both forms the same way)."""
    if isinstance(impl, KernelBackend):
        return impl.value
    return ",".join(v.value if isinstance(v, KernelBackend) else str(v) for v in impl)


def _current(op_id: str) -> Op:
    """The op object registered under ``op_id`` now (a dict read; ``get_op`` on a miss)."""
    op = registry.loaded_op(op_id)
    return op if op is not None else registry.get_op(op_id)


def _storage_id(t: torch.Tensor) -> int | None:
    try:
        return _compat.storage_id(t)
    except Exception:  # tensors without storage (some subclasses) cannot alias
        return None


def _fresh(outputs: Sequence[Any], inputs: Sequence[Any]) -> list[Any]:
    """Outputs that alias no input and no other output, each contiguous (the fake impl's layout)."""
    seen = {s for a in inputs if isinstance(a, torch.Tensor) and (s := _storage_id(a)) is not None}
    out = []
    for o in outputs:
        if isinstance(o, torch.Tensor):
            s = _storage_id(o)
            if s is not None and s in seen:
                o = o.clone(memory_format=torch.contiguous_format)
                s = _storage_id(o)
            elif not o.is_contiguous():
                o = o.contiguous()
            if o.requires_grad:
                o = o.detach()
            if s is not None:
                seen.add(s)
        out.append(o)
    return out


def _as_tuple(out: Any) -> tuple[Any, ...]:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


# A guard that takes autograd's keys out of this thread's excluded dispatch keys: a custom op's
# kernels run below autograd (polykernel._compat: without the private guard, none).
_autograd_on = _compat.autograd_keys_on


def _reference_outputs(op: Op, args: Sequence[Any]) -> tuple[Any, ...]:
    """The reference's outputs on fake (or meta) arguments, for their shapes and dtypes.

    The reference runs as at the top of a trace, with the autograd keys on (a fake impl runs below
    autograd): composite ops such as cross_entropy then decompose through their C++ kernels.
    Below autograd, FakeTensorMode decomposes them through Python refs, some of which are wrong
    (torch 2.13's nll_loss ref misreads ``reduction``: a [0]-shaped mean for empty inputs, a
    scalar for "none"). Where this torch has no guard for that, the op's declared ``outputs``
    (checked against the reference on each decision's first call) give them instead."""
    if not _compat.autograd_keys_guarded() and op.outputs is not None:
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        return tuple(torch.empty(shape, dtype=dtype, device=device) for shape, dtype in op.outputs(*args))
    with _autograd_on(), torch.no_grad():
        return _as_tuple(op.reference(*args))


def _compile_mode(op: Op, name: str) -> str:
    """``POLYKERNEL_COMPILE_<NAME>`` if set, else the op's ``compile_mode``; either must be a mode."""
    env = f"POLYKERNEL_COMPILE_{name.upper()}"
    mode = os.environ.get(env) or op.compile_mode
    # "eager" is an op's own fact (its outputs have no schema), never a choice of the variable
    if mode not in MODES or (mode == "eager" and os.environ.get(env)):
        where = env if os.environ.get(env) else f"{op.id}: compile_mode"
        raise ValueError(f"{where}: {mode!r} is not 'ours' or 'decompose'")
    return mode


class CompiledOp:
    """The custom ops of one :class:`Op`: ``forward`` and ``backward`` (``OpOverload`` s)."""

    def __init__(self, op: Op, name: str) -> None:
        self.op_id = op.id
        self.name = name
        self.qualname = f"{NAMESPACE}::{name}"
        if op.compile_mode == "eager":  # no custom op: Dynamo breaks the graph around the eager call
            self.mode, self.writes = "eager", ()
            slow, validate = op._dispatch_slow, op.validate

            @torch.compiler.disable
            def eager(impl: Any, *args: Any) -> Any:
                if validate is not None:  # every call: such ops' validity may depend on data (token ids)
                    validate(*args)
                return slow(impl, args)

            self.call = eager
            return
        params, returns = _params(op)
        self.params = params
        self.returns = returns
        self.n_args = len(params)
        self.tensor_args = tuple(i for i, p in enumerate(params) if p.type in ("Tensor", "Tensor?"))
        self.single = len(returns) == 1 and not returns[0].endswith("[]")
        # The dispatcher drops trailing arguments equal to their schema default before calling a
        # Python kernel; the kernels put them back from here.
        self.defaults = tuple(p.value for p in params)
        self.key_names = _key_names(op, [p.name for p in params])
        self.writes = tuple(getattr(op, "writes", ()))
        if self.writes:  # an op that writes into given tensors: one mutating custom op, no autograd
            self._init_writing(op, params)
            return
        self.forward_schema = _schema(params, returns, with_defaults=True)
        self.backward_schema = _schema(
            params, ["Tensor[]"], with_defaults=False, prefix="Tensor?[] grad_outputs", suffix="bool[] grad_mask"
        )
        # Training ops: fixed arity (see the module docstring), tensors one by one, not lists.
        self.saved_kinds = op.saved or ()
        self.uses_split = op.saved is not None
        n_out, n_saved = len(returns), len(self.saved_kinds)
        self.train_schema = _schema(params, [*returns, *["Tensor"] * n_saved], with_defaults=False, suffix="bool[] grad_mask")
        head = [f"Tensor? grad_output_{i}" for i in range(n_out)] + [f"Tensor saved_{i}" for i in range(n_saved)]
        self.train_backward_schema = _schema(
            params, ["Tensor"] * len(self.tensor_args), with_defaults=False, prefix=", ".join(head), suffix="bool[] grad_mask"
        )
        self.forward = self._define_forward()
        self.backward = self._define_backward()
        self.train_backward = self._define_train_backward()
        self.train = self._define_train()
        self.mode = mode = _compile_mode(op, name)
        fwd, train, validate, reference = self.forward, self.train, getattr(op, "validate", None), op.reference
        decompose, single, op_id, n_out, full = mode == "decompose", self.single, op.id, len(returns), self._full

        def call(impl: Any, *args: Any) -> Any:
            # Traced by Dynamo: validation runs at trace time, on the (fake) arguments. Dynamo
            # cannot raise an exception out of a fullgraph trace (it reports `Unsupported`), so a
            # call that fails validation is traced as the plain custom op, whose real impl
            # validates again when the graph runs and raises the OpArgumentError itself.
            if validate is not None:
                try:
                    validate(*args)
                    valid = True
                except OpArgumentError:
                    valid = False
                if not valid:
                    return fwd(*args, impl=impl if impl is None or isinstance(impl, str) else _impl_str(impl))
            if impl is not None and not isinstance(impl, str):  # a list or a KernelBackend
                impl = _impl_str(impl)
            dtensors = _has_dtensor(args)
            if dtensors:  # the ops' sharding rules, registered at trace time (once)
                _at_trace_time("register_rules", op_id)
                from . import sharding as dtensor_sharding

                if dtensor_sharding.sharded_mean(op_id, args):
                    # A mean loss over sharded rows: this call with reduction="sum" (its rules give
                    # a Partial loss; the train ops too) over the global count of scored rows.
                    return dtensor_sharding.mean_of_sum(op_id, lambda *a: call(impl, *a), full(args))
            if decompose and impl is None:  # Inductor's own code is as fast: let it fuse the op
                return reference(*args)
            if torch.is_grad_enabled():
                mask = [isinstance(a, torch.Tensor) and a.requires_grad for a in args]
                why = dtensor_sharding.why_not(op_id, args) if any(mask) and impl is None and dtensors else None
                if why is not None:
                    # No sharding rule covers the training ops here (see dtensor_sharding): the op
                    # decomposes into torch ops that DTensor and Inductor handle.
                    _at_trace_time("report_decomposing", op_id, why)
                    return reference(*args)
                if any(mask):  # training: the forward returns what the backward needs
                    outs = _as_tuple(train(*args, mask, impl=impl))[:n_out]
                    return outs[0] if single else tuple(outs)
            return fwd(*args, impl=impl)

        self.call = call

    def __repr__(self) -> str:
        return f"CompiledOp({self.qualname}{self.forward_schema})"

    # -- ops that write into given tensors (Op.writes: the serving ops) -------------------------
    def _init_writing(self, op: Op, params: Sequence[_Param]) -> None:
        """``polykernel::<name>(..., Tensor(a!) out, ...) -> ()``: the real impl dispatches (the
        impl writes its results into the destinations), the fake impl writes nothing, and the
        compiled call returns the destinations, in the order of ``Op.writes``, as the eager call
        does. Functionalization sees the mutation, so Inductor keeps it (auto_functionalized,
        re-inplaced where it can). Inference only: no backward or training custom ops."""
        names = [p.name for p in params]
        written = tuple(names.index(w) for w in self.writes)  # in the order of Op.writes
        marked = list(params)
        for k, i in enumerate(sorted(written)):
            p = params[i]
            if p.type not in ("Tensor", "Tensor?"):
                raise TypeError(f"polykernel: {op.id}: written parameter {p.name!r} must be a tensor (it is {p.type})")
            marked[i] = p._replace(type=f"Tensor({chr(ord('a') + k)}!){'?' if p.type.endswith('?') else ''}")
        self.forward_schema = _schema(marked, ["()"], with_defaults=True)
        self.backward_schema = self.train_schema = self.train_backward_schema = None
        self.saved_kinds, self.uses_split = (), False
        self.backward = self.train = self.train_backward = None
        self.mode = mode = _compile_mode(op, self.name)
        op_id, full, key_names = self.op_id, self._full, self.key_names

        def real(*args: Any, impl: str | None = None) -> None:
            # Every call validated on the real tensors: such ops check memory (overlaps) and data
            # (positions) that the trace's fake tensors do not have, and a call that failed the
            # trace's checks raises here (see `call`).
            op = _current(op_id)
            args = full(args)
            if op.validate is not None:
                op.validate(*args)
            with torch.no_grad():
                _select_and_run(op, impl, args, key_names)

        def fake(*args: Any, impl: str | None = None) -> None:
            return None

        custom = torch.library.custom_op(self.qualname, real, mutates_args=self.writes, schema=self.forward_schema)
        custom.register_fake(fake)
        self.forward = custom._opoverload
        fwd, validate, reference, decompose = self.forward, getattr(op, "validate", None), op.reference, mode == "decompose"
        single = len(written) == 1

        def call(impl: Any, *args: Any) -> Any:
            # Traced by Dynamo, like the functional ops' call: a call that fails validation at
            # trace time is traced as the custom op, whose real impl raises the OpArgumentError.
            valid = True
            if validate is not None:
                try:
                    validate(*args)
                except OpArgumentError:
                    valid = False
            if impl is not None and not isinstance(impl, str):  # a list or a KernelBackend
                impl = _impl_str(impl)
            if decompose and impl is None and valid:  # the reference writes the destinations with torch ops
                return reference(*args)
            fwd(*args, impl=impl)
            args = full(args)
            return args[written[0]] if single else tuple(args[i] for i in written)

        self.call = call

    # -- forward -------------------------------------------------------------------------------
    def _full(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return args if len(args) == self.n_args else (*args, *self.defaults[len(args) :])

    def _define_forward(self) -> Any:
        op_id, single, full, names = self.op_id, self.single, self._full, self.key_names

        def real(*args: Any, impl: str | None = None) -> Any:
            args = full(args)
            with torch.no_grad():
                out = _as_tuple(_select_and_run(_current(op_id), impl, args, names))
            out = _fresh(out, args)
            return out[0] if single else tuple(out)

        def fake(*args: Any, impl: str | None = None) -> Any:
            args = full(args)
            op = _current(op_id)
            try:
                out = _reference_outputs(op, args)
            except Exception:
                # A call that fails validation is traced to raise at run time (see `call`); the
                # reference may refuse it too (label_smoothing=2): the op's output shapes instead.
                if op.outputs is None or _valid(op, args):
                    raise
                out = tuple(torch.empty(shape, dtype=dtype, device=args[0].device) for shape, dtype in op.outputs(*args))
            out = [torch.empty(o.shape, dtype=o.dtype, device=o.device) if isinstance(o, torch.Tensor) else o for o in out]
            return out[0] if single else tuple(out)

        custom = torch.library.custom_op(self.qualname, real, mutates_args=(), schema=self.forward_schema)
        custom.register_fake(fake)
        custom.register_autograd(self._backward_formula, setup_context=self._setup_context)
        return _compat.custom_op_overload(custom, self.qualname)

    def _setup_context(self, ctx: Any, inputs: Sequence[Any], keyword_only_inputs: dict[str, Any], output: Any) -> None:
        tensors = set(self.tensor_args)
        ctx.save_for_backward(*(inputs[i] for i in self.tensor_args))
        ctx.pk_consts = [None if i in tensors else a for i, a in enumerate(inputs)]
        ctx.pk_impl = keyword_only_inputs.get("impl")

    def _backward_formula(self, ctx: Any, *grads: Any) -> tuple[Any, ...]:
        args = list(ctx.pk_consts)
        for i, t in zip(self.tensor_args, ctx.saved_tensors):
            args[i] = t
        needs = ctx.needs_input_grad  # one per argument the call passed (defaults may be dropped)
        mask = [i < len(needs) and bool(needs[i]) for i in range(self.n_args)]
        result = iter(self.backward(list(grads), *args, mask, impl=ctx.pk_impl))
        return tuple(next(result) if m else None for m in mask[: len(needs)])

    # -- backward ------------------------------------------------------------------------------
    def _define_backward(self) -> Any:
        op_id, names = self.op_id, self.key_names

        def real(grad_outputs: list[torch.Tensor | None], *rest: Any, impl: str | None = None) -> list[torch.Tensor]:
            *args, mask = rest
            op = _current(op_id)

            def recompute() -> tuple[Sequence[Any], list[Any]]:  # through autograd, which this kernel runs below
                leaves = [a.detach().requires_grad_(bool(m)) if isinstance(a, torch.Tensor) else a for a, m in zip(args, mask)]
                wanted = [leaf for leaf, m in zip(leaves, mask) if m]
                outs = _as_tuple(_select_and_run(op, impl, leaves, names))
                pairs = [(o, g) for o, g in zip(outs, grad_outputs) if g is not None and isinstance(o, torch.Tensor) and o.requires_grad]
                if pairs and wanted:
                    return torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True), wanted
                return (None,) * len(wanted), wanted

            got, wanted = _compat.with_autograd(recompute)
            grads = [g if g is not None else torch.zeros_like(w, memory_format=torch.contiguous_format) for g, w in zip(got, wanted)]
            return _fresh(grads, [*args, *grad_outputs])

        def fake(grad_outputs: list[torch.Tensor | None], *rest: Any, impl: str | None = None) -> list[torch.Tensor]:
            *args, mask = rest
            return [torch.empty(a.shape, dtype=a.dtype, device=a.device) for a, m in zip(args, mask) if m]

        custom = torch.library.custom_op(f"{self.qualname}_backward", real, mutates_args=(), schema=self.backward_schema)
        custom.register_fake(fake)
        self._recompute = real
        return _compat.custom_op_overload(custom, f"{self.qualname}_backward")

    # -- training: forward with saved activations, backward without recompute -------------------
    def _fit_saved(self, saved: Sequence[torch.Tensor], lead: torch.Tensor) -> list[torch.Tensor]:
        """A split's ``saved`` as the training op returns it: padded with empty tensors to the op's
        count, and each "rows" tensor shaped ``lead.shape[:-1]`` (see :mod:`.facts`)."""
        out = list(saved)
        out += [torch.empty((0,), dtype=torch.float32, device=lead.device) for _ in range(len(self.saved_kinds) - len(out))]
        rows = lead.shape[:-1]
        for i, kind in enumerate(self.saved_kinds):
            if kind == "rows" and out[i].dim() == 1 and out[i].numel() == math.prod(rows):
                out[i] = out[i].reshape(rows)
        return out

    def _split_saved(self, saved: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The training op's saved tensors back in the split's layout ("rows" flat again)."""
        return [s.reshape(-1) if kind == "rows" and s.dim() != 1 else s for s, kind in zip(saved, self.saved_kinds)]

    def _define_train(self) -> Any:
        op_id, names, full, uses_split, fit = self.op_id, self.key_names, self._full, self.uses_split, self._fit_saved

        def saved_by_layout(op: Op, args: Sequence[Any], mask: Sequence[bool], fake: bool) -> list[torch.Tensor]:
            split = _layout_split(op) if uses_split else None
            if split is None:
                return []
            if fake and split.layout is not None:
                return list(split.layout(*args, list(mask)))
            return list(split.forward(*args, list(mask))[1])

        def real(*rest: Any, impl: str | None = None) -> Any:
            *args, mask = rest
            args = full(tuple(args))
            op = _current(op_id)
            decision = _training_decision(op, impl, args, names)
            split = _split_of(decision.fn_for(args)) if uses_split else None
            saved = None
            with torch.no_grad():
                try:
                    if split is not None:
                        outs, saved = split.forward(*args, list(mask))
                    else:
                        outs = decision.fn(*args)
                except Exception as exc:  # the fault policy: falls back (a plain call) or re-raises
                    outs, saved = decision.on_fault(exc, tuple(args)), None
                if saved is None:  # no split ran: the op's layout, from the torch impl's split
                    saved = saved_by_layout(op, args, mask, fake=False)
            out = _fresh([*_as_tuple(outs), *fit(saved, args[0])], args)
            return out[0] if len(out) == 1 else tuple(out)

        def fake(*rest: Any, impl: str | None = None) -> Any:
            *args, mask = rest
            args = full(tuple(args))
            op = _current(op_id)
            outs = _reference_outputs(op, args)
            with _autograd_on(), torch.no_grad():  # see _reference_outputs
                saved = saved_by_layout(op, args, mask, fake=True)
            out = [torch.empty(o.shape, dtype=o.dtype, device=o.device) for o in (*outs, *fit(saved, args[0]))]
            return out[0] if len(out) == 1 else tuple(out)

        custom = torch.library.custom_op(f"{self.qualname}_train", real, mutates_args=(), schema=self.train_schema)
        custom.register_fake(fake)
        custom.register_autograd(self._train_formula, setup_context=self._train_setup)
        return _compat.custom_op_overload(custom, f"{self.qualname}_train")

    def _train_setup(self, ctx: Any, inputs: Sequence[Any], keyword_only_inputs: dict[str, Any], output: Any) -> None:
        *args, _mask = inputs
        saved = _as_tuple(output)[len(self.returns) :]
        tensors = set(self.tensor_args)
        ctx.save_for_backward(*(args[i] for i in self.tensor_args), *saved)
        ctx.pk_consts = [None if i in tensors else a for i, a in enumerate(args)]
        ctx.pk_impl = keyword_only_inputs.get("impl")
        ctx.set_materialize_grads(False)  # no zeros for the saved tensors' (absent) gradients
        ctx.mark_non_differentiable(*saved)

    def _train_formula(self, ctx: Any, *grads: Any) -> tuple[Any, ...]:
        n_t = len(self.tensor_args)
        stored = ctx.saved_tensors
        args = list(ctx.pk_consts)
        for i, t in zip(self.tensor_args, stored[:n_t]):
            args[i] = t
        mask = [bool(m) for m in ctx.needs_input_grad[: self.n_args]]
        scaled = self._scaled_saved(grads, stored[n_t:], args, mask)
        if scaled is not None:
            return (*scaled, None)
        # An output that took no gradient goes as None (the backward makes its zeros: here they
        # would be plain tensors among DTensors); the saved tensors' gradients are dropped.
        got = _as_tuple(self.train_backward(*grads[: len(self.returns)], *stored[n_t:], *args, mask, impl=ctx.pk_impl))
        by_arg = dict(zip(self.tensor_args, got))
        return (*(by_arg[i] if m else None for i, m in enumerate(mask)), None)

    def _scaled_saved(self, grads: Sequence[Any], saved: Sequence[Any], args: Sequence[Any], mask: Sequence[bool]) -> list[Any] | None:
        """The gradients as ``saved * grad_output`` (see ``Op.saved_grads``), in torch ops that
        the compiled backward graph sees; None where that does not apply (the backward custom op
        runs). DTensors keep the custom op, whose sharding rules place the gradients."""
        entry: SavedGrads | None = _current(self.op_id).saved_grads  # read while tracing: a benchmark may drop it
        if entry is None or len(self.returns) != 1:
            return None
        names = [p.name for p in self.params]
        slots = {names.index(name): slot for name, slot in entry.slots.items()}  # argument index -> slot
        g = grads[0]
        if (
            g is None
            or any(m and i not in slots for i, m in enumerate(mask))
            or not entry.when(dict(zip(names, args)))
            or _has_dtensor([g, *saved, *args])
        ):
            return None
        # Each slot holds its argument's gradient shaped like the argument, in its dtype or wider
        # (grad_bias is fp32): the multiply runs in the saved dtype, as the split's backward did.
        return [torch.mul(saved[slots[i]], g).view(args[i].shape).to(args[i].dtype) if m else None for i, m in enumerate(mask)]

    def _define_train_backward(self) -> Any:
        op_id, names, recompute, uses_split = self.op_id, self.key_names, self._recompute, self.uses_split
        n_out, n_saved, tensor_args, unflatten = len(self.returns), len(self.saved_kinds), self.tensor_args, self._split_saved

        def grad_or_placeholder(got: Sequence[Any], args: Sequence[Any], mask: Sequence[bool], fake: bool) -> list[torch.Tensor]:
            """One tensor per tensor argument: its gradient where asked for (zeros when the
            split gave None), else an empty placeholder of the argument's rank."""
            lead, out = args[0], []
            for i in tensor_args:
                a = args[i]
                if not mask[i]:
                    shape = (0,) * a.dim() if isinstance(a, torch.Tensor) else (0,)
                    like = a if isinstance(a, torch.Tensor) else lead
                    out.append(torch.empty(shape, dtype=like.dtype, device=like.device))
                elif fake:
                    out.append(torch.empty(a.shape, dtype=a.dtype, device=a.device))
                elif got[i] is None:
                    out.append(torch.zeros_like(a, memory_format=torch.contiguous_format))
                else:
                    out.append(got[i])
            return out

        def real(*rest: Any, impl: str | None = None) -> Any:
            grads, saved = list(rest[:n_out]), list(rest[n_out : n_out + n_saved])
            *args, mask = rest[n_out + n_saved :]
            op = _current(op_id)
            split = _split_of(_training_decision(op, impl, args, names).fn_for(args)) if uses_split else None
            if split is None:  # an impl without a split (a peer, say): recompute its forward
                it = iter(recompute(grads, *args, mask, impl=impl))
                got = [next(it) if m else None for m in mask]
            else:
                with torch.no_grad():
                    got = list(split.backward(_output_grads(op, grads, args), unflatten(saved), *args, list(mask)))
            out = _fresh(grad_or_placeholder(got, args, mask, fake=False), [*args, *grads, *saved])
            return out[0] if len(out) == 1 else tuple(out)

        def fake(*rest: Any, impl: str | None = None) -> Any:
            *args, mask = rest[n_out + n_saved :]
            out = grad_or_placeholder((), args, mask, fake=True)
            return out[0] if len(out) == 1 else tuple(out)

        custom = torch.library.custom_op(f"{self.qualname}_train_backward", real, mutates_args=(), schema=self.train_backward_schema)
        custom.register_fake(fake)
        return _compat.custom_op_overload(custom, f"{self.qualname}_train_backward")


def _output_grads(op: Op, grads: Sequence[torch.Tensor | None], args: Sequence[Any]) -> list[torch.Tensor]:
    """``grads`` with zeros for the outputs that took none (a split's backward wants a tensor
    for every output); their shapes come from the reference run on meta tensors."""
    if all(g is not None for g in grads):
        return list(grads)
    metas = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in args]
    outs = _reference_outputs(op, metas)
    device = args[0].device
    return [g if g is not None else torch.zeros(o.shape, dtype=o.dtype, device=device) for g, o in zip(grads, outs)]


# ---------------------------------------------------------------------------------------------
# Building: once per op, when it registers (so Dynamo only ever traces the dict read above)


def _free_name(op: Op) -> str:
    name = op.name
    owner = _taken.get(name)
    if owner is not None and owner != op.id:
        name = op.id.replace(".", "_")
    return name


def _build(op: Op) -> CompiledOp:
    with _lock:
        hit = _built.get(op.id)
        if hit is not None:
            if getattr(op, _ATTR, None) is None:  # an Op object re-created under the same id
                setattr(op, _ATTR, hit.call)
            return hit
        name = _free_name(op)
        try:
            hit = CompiledOp(op, name)
        except Exception as exc:
            _errors[op.id] = f"{type(exc).__name__}: {exc}"
            raise RuntimeError(f"polykernel: {op.id}: cannot build its torch.library custom op: {exc}") from exc
        _errors.pop(op.id, None)
        _taken[name] = op.id
        _built[op.id] = hit
        setattr(op, _ATTR, hit.call)
        if "torch.distributed.tensor" in sys.modules:  # DTensor is in use (Dynamo loads it too): sharding rules
            from . import sharding as dtensor_sharding

            dtensor_sharding.register(op, hit)
        return hit


def _build_registered(op_id: str | None = None) -> None:
    """Build the custom op of every registered op that lacks one (registry listener; ``op_id``,
    the op whose impls changed, is not needed: building is idempotent and cheap when done)."""
    for op in registry.loaded_ops():
        if getattr(op, _ATTR, None) is None and op.id not in _errors:
            try:
                _build(op)
            except Exception:  # recorded in _errors; custom_op_for raises it on use
                pass


registry.listen(_build_registered)
_build_registered()
