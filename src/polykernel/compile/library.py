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

import sys
from collections.abc import Callable
from typing import Any

from ..core import registry
from ..core.op import Op

# The layer's modules, one concern each: ``store`` (what is built), ``schema`` (schemas from the
# reference), ``runtime`` (the custom ops' bodies), ``trace_time`` (side effects while tracing),
# ``compiled_op`` (one op's custom ops); here, the lookup and the building. Private names that
# other modules and tests read are re-exported here (the objects themselves: the dicts are
# mutated in place, never rebound).
from .compiled_op import CompiledOp, _compile_mode  # noqa: F401
from .facts import SavedGrads
from .runtime import _fresh, _layout_split  # noqa: F401
from .store import _ATTR, NAMESPACE, BuiltOp, _built, _errors, _lock, _taken
from .trace_time import _TRACE_TIME, _at_trace_time  # noqa: F401

__all__ = ["NAMESPACE", "CompiledOp", "SavedGrads", "build_errors", "custom_op_for"]


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


def built() -> dict[str, BuiltOp]:
    """Op id -> its custom ops, for the ops built so far."""
    return dict(_built)


def build_errors() -> dict[str, str]:
    """Ops whose custom op could not be built (op id -> error). Empty when all is well."""
    return dict(_errors)


# ---------------------------------------------------------------------------------------------
# Building: once per op, when it registers (so Dynamo only ever traces the dict read above)


def _free_name(op: Op) -> str:
    name = op.name
    owner = _taken.get(name)
    if owner is not None and owner != op.id:
        name = op.id.replace(".", "_")
    return name


def _build(op: Op) -> BuiltOp:
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
