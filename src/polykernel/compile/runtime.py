"""The run-time bodies of the custom ops: select and run through the dispatcher, outputs that
alias nothing, the reference's outputs on fake tensors, the torch impl's split (the saved layout)."""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Sequence
from typing import Any

import torch

from .. import _compat
from ..core import registry
from ..core.op import Op, _has_tangent
from ..errors import OpArgumentError, OpTypeError
from ..spec import KernelBackend, Split
from .store import NAMESPACE


def _has_dtensor(args: Sequence[Any]) -> bool:
    """Whether any argument is a DTensor (only looked up if torch.distributed.tensor is loaded)."""
    mod = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(mod, "DTensor", None)
    return dtensor is not None and any(isinstance(a, dtensor) for a in args)


def _autocast_off(op: Op, args: Sequence[Any]) -> contextlib.AbstractContextManager[Any]:
    """Autocast off for the first tensor argument's device, for an op with an ``autocast`` hook
    (the fused linear ops: their impls, a peer's too, run on the cast heads with autocast off, as
    their eager public functions run them). A custom op does not turn autocast off by itself: its
    kernel runs with the caller's autocast state, and autocast would lower a peer's matmuls."""
    if op.autocast is None or not _compat.any_autocast_enabled():
        return contextlib.nullcontext()
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    try:
        return torch.autocast(first.device.type, enabled=False) if first is not None else contextlib.nullcontext()
    except RuntimeError:  # a device type autocast does not know: nothing to turn off
        return contextlib.nullcontext()


def _select_and_run(op: Op, impl: str | None, args: Sequence[Any], names: Sequence[str] | None) -> Any:
    """The dispatcher's eager path (:meth:`Op.run`: ``Op.call`` minus its compile check, which
    would re-enter the custom op while a compile is in progress), autocast off for an op with an
    ``autocast`` hook. ``names``: pass the arguments to ``op.key`` by name (its signature is the
    public function's, with keyword-only options)."""
    argkey = op.key(**dict(zip(names, args))) if names is not None else op.key(*args)
    with _autocast_off(op, args):
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


def _validate_on_cpu(op: Op, args: Sequence[Any]) -> None:
    """Validate a compiled call on its real arguments when they are on the CPU, on every call:
    there the eager public functions check what the argument class cannot hold, the values (a
    target's class range, the expert indices), on every call. The trace validated the fake
    tensors, which have none, and the dispatcher validates a class once: without this, a later
    out-of-range target ran (NaN losses, silently). Off the CPU such checks would cost a host
    sync per call; eager skips them there too (the impls check the indices on the device)."""
    if op.validate is not None and any(isinstance(a, torch.Tensor) and a.is_cpu for a in args):
        op.validate(*args)


# Whether _compat reads the forward-AD level itself; its fallback says "open" on every call.
_LEVEL_READ = "forward_ad_level" not in _compat.fallbacks()


def _transformed(args: Sequence[Any]) -> bool:
    """Whether a compiled call must trace the op's reference: a torch.func transform is active
    (its wrapped tensors reach no custom op's fake impl) or a forward-AD dual level is open (a
    custom op has no forward-mode rule: its outputs would lose the tangents, a zero derivative,
    silently). Eager calls run the reference then too (:meth:`Op.forward_ad`). Dynamo shows a
    graph input's tangent to no trace, so an open level is enough (where it can be read)."""
    if _compat.functorch_transforms_active():
        return True
    return _compat.forward_ad_open() and (_LEVEL_READ or _has_tangent(args))


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
    parses both forms the same way). Anything that is no name (``impl=5``) becomes its repr,
    which names no impl: the custom op raises the dispatcher's ``UnknownImplError`` for it when
    the graph runs, as the eager call does (iterating it here raised in the traced code: a
    fullgraph "Observed exception", a RecursionError inside Dynamo without fullgraph)."""
    if isinstance(impl, KernelBackend):
        return impl.value
    if isinstance(impl, str):
        return impl
    if not isinstance(impl, (list, tuple)):
        return repr(impl)
    return ",".join(v.value if isinstance(v, KernelBackend) else v if isinstance(v, str) else repr(v) for v in impl)


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


def _output_grads(op: Op, grads: Sequence[torch.Tensor | None], args: Sequence[Any]) -> list[torch.Tensor]:
    """``grads`` with zeros for the outputs that took none (a split's backward wants a tensor
    for every output); their shapes come from the reference run on meta tensors."""
    if all(g is not None for g in grads):
        return list(grads)
    metas = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in args]
    outs = _reference_outputs(op, metas)
    device = args[0].device
    return [g if g is not None else torch.zeros(o.shape, dtype=o.dtype, device=device) for g, o in zip(grads, outs)]


# -- a call that fails validation while Dynamo traces it ---------------------------------------
# Dynamo cannot raise out of a fullgraph trace, so the error is put in the graph: a node that
# raises it, with the trace's message, when the graph runs. The custom op's own run-time check is
# not enough: its schema converts what it takes (a bool for a float is 1.0, for an int 1), and the
# converted value passes (eps=True ran with eps=1.0, silently).


def _raise_argument_error(op: str, arg: str, message: str, type_error: bool) -> None:
    raise (OpTypeError if type_error else OpArgumentError)(op, arg, message)


_argument_error_op = torch.library.custom_op(
    f"{NAMESPACE}::argument_error", _raise_argument_error, mutates_args=(), schema="(str op, str arg, str message, bool type_error) -> ()"
)
_argument_error_op.register_fake(lambda op, arg, message, type_error: None)
torch.fx.node.has_side_effect(_argument_error_op._opoverload)  # returns nothing: kept all the same


def _argument_error(exc: OpArgumentError) -> None:
    """``exc`` raised when the compiled graph runs (now, outside a trace)."""
    op, arg, *message = exc.args
    _argument_error_op._opoverload(op, arg, message[0] if message else "", isinstance(exc, TypeError))


_FITS: dict[str, tuple[type, ...]] = {"float": (float, int), "SymInt": (int,), "bool": (bool,), "str": (str,)}


def _schema_fit(types: Sequence[str], defaults: Sequence[Any], args: Sequence[Any]) -> tuple[Any, ...]:
    """``args`` with each option its schema type cannot hold (a bool for a float, a float for an
    int) replaced by its default, and each non-tensor where a tensor goes by a stand-in (None for
    an optional one, else one of the call's tensors), so that a call that fails validation still
    traces (its outputs' shapes) up to the node that raises the error (without the stand-in, the
    custom op's schema check fails the trace first, with torch's message instead of the op's)."""
    out = list(args)
    stand_in = next((a for a in args if isinstance(a, torch.Tensor)), None)
    for i, (tp, a) in enumerate(zip(types, args)):
        if tp in ("Tensor", "Tensor?") and not isinstance(a, torch.Tensor):
            if a is not None or tp == "Tensor":
                out[i] = None if tp == "Tensor?" else stand_in if stand_in is not None else torch.empty(0)
            continue
        fits = _FITS.get(tp.rstrip("?"))
        if fits is None or (a is None and tp.endswith("?")):
            continue
        if (isinstance(a, bool) and bool not in fits) or not isinstance(a, fits):
            if defaults[i] is not inspect.Parameter.empty:
                out[i] = defaults[i]
    return tuple(out)
