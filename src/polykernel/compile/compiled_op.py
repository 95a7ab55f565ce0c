"""One op's custom ops (:class:`CompiledOp`): the forward and backward, the fixed-arity training
pair, or the one mutating op of an op that writes into given tensors; and the op's compile mode."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import torch

from .. import _compat
from ..core.op import Op
from ..errors import OpArgumentError
from .facts import MODES, SavedGrads
from .runtime import (
    _argument_error,
    _as_tuple,
    _autocast_off,
    _autograd_on,
    _current,
    _fresh,
    _has_dtensor,
    _impl_str,
    _key_names,
    _layout_split,
    _output_grads,
    _reference_outputs,
    _schema_fit,
    _select_and_run,
    _split_of,
    _training_decision,
    _transformed,
    _valid,
    _validate_on_cpu,
)
from .schema import _Param, _params, _schema
from .store import NAMESPACE
from .trace_time import _at_trace_time


def _compile_mode(op: Op, name: str) -> str:
    """``POLYKERNEL_COMPILE_<NAME>`` if set, else the op's ``compile_mode``; either must be a mode."""
    env = f"POLYKERNEL_COMPILE_{name.upper()}"
    mode = os.environ.get(env) or op.compile_mode
    # "eager" is an op's own fact (its outputs have no schema), never a choice of the variable
    if mode not in MODES or (mode == "eager" and os.environ.get(env)):
        where = env if os.environ.get(env) else f"{op.id}: compile_mode"
        raise ValueError(f"{where}: {mode!r} is not 'ours' or 'decompose'")
    return mode


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


class CompiledOp:
    """The custom ops of one :class:`Op`: ``forward`` and ``backward`` (``OpOverload`` s)."""

    def __init__(self, op: Op, name: str) -> None:
        self.op_id = op.id
        self.name = name
        self.qualname = f"{NAMESPACE}::{name}"
        if op.compile_mode == "eager":  # no custom op: Dynamo breaks the graph around the eager call
            self.mode, self.writes = "eager", ()
            slow, validate, hook = op._dispatch_slow, op.validate, op.autocast

            @torch.compiler.disable
            def eager(impl: Any, *args: Any) -> Any:
                if hook is not None and _compat.any_autocast_enabled():  # as the eager call: cast heads, autocast off
                    args = hook(args)
                with _autocast_off(op, args):
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
        mistyped, types, defaults = op._mistyped, [p.type for p in params], self.defaults
        autocast = op.autocast

        def call(impl: Any, *args: Any) -> Any:
            # Traced by Dynamo: validation runs at trace time, on the (fake) arguments, with the
            # option types the eager slow path checks. Dynamo cannot raise an exception out of a
            # fullgraph trace (it reports `Unsupported`), so a call that fails is traced as a node
            # that raises the error when the graph runs (see runtime._argument_error), then the
            # plain custom op on arguments its schema holds (the outputs' shapes for the trace).
            wrong = None
            if validate is not None:
                try:
                    validate(*args)
                except OpArgumentError as exc:
                    wrong = exc
            wrong = wrong or mistyped(args)
            if wrong is not None:
                _argument_error(wrong)
                return fwd(*_schema_fit(types, defaults, args), impl=impl if impl is None or isinstance(impl, str) else _impl_str(impl))
            if impl is not None and not isinstance(impl, str):  # a list or a KernelBackend
                impl = _impl_str(impl)
            if autocast is not None:  # the custom op runs with autocast off: its eager casts, traced here
                args = autocast(args)
            dtensors = _has_dtensor(args)
            if dtensors:  # the ops' sharding rules, registered at trace time (once)
                _at_trace_time("register_rules", op_id)
                from . import sharding as dtensor_sharding

                if dtensor_sharding.sharded_mean(op_id, args):
                    # A mean loss over sharded rows: this call with reduction="sum" (its rules give
                    # a Partial loss; the train ops too) over the global count of scored rows.
                    return dtensor_sharding.mean_of_sum(op_id, lambda *a: call(impl, *a), full(args))
            if decompose and impl is None:  # Inductor's own code is as fast: let it fuse the op
                _at_trace_time("report_unforced", op_id)  # a set_impl/env/scope for this op: not run
                return reference(*args)
            if _transformed(args):  # torch.func, dual tensors: torch ops carry them (see _transformed)
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
            # (positions) that the trace's fake tensors do not have (a call that failed the
            # trace's checks never gets here: see `call`).
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
            # trace time is traced as a node that raises the error when the graph runs, and
            # writes nothing (the custom op would run on the values its schema converted).
            if validate is not None:
                try:
                    validate(*args)
                except OpArgumentError as exc:
                    _argument_error(exc)
                    args = full(args)
                    return args[written[0]] if single else tuple(args[i] for i in written)
            if impl is not None and not isinstance(impl, str):  # a list or a KernelBackend
                impl = _impl_str(impl)
            if decompose and impl is None:  # the reference writes the destinations with torch ops
                _at_trace_time("report_unforced", op_id)
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
            op = _current(op_id)
            _validate_on_cpu(op, args)  # the values, every call (see _validate_on_cpu)
            with torch.no_grad():
                out = _as_tuple(_select_and_run(op, impl, args, names))
            out = _fresh(out, args)
            return out[0] if single else tuple(out)

        def fake(*args: Any, impl: str | None = None) -> Any:
            args = full(args)
            op = _current(op_id)
            # (only while compiling: validate reads a CPU target's values otherwise, which fake
            # tensors lack: opcheck's fake-tensor tests)
            if op.outputs is not None and torch.compiler.is_compiling() and not _valid(op, args):
                # A call that fails validation, traced to raise at run time (see `call`): the
                # op's output shapes, not the reference, which may refuse such arguments (shapes
                # that do not broadcast), and each refusal of a meta kernel is an ERROR traceback
                # in torch's log before the op's own error.
                try:
                    out = tuple(torch.empty(shape, dtype=dtype, device=args[0].device) for shape, dtype in op.outputs(*args))
                    return out[0] if single else out
                except Exception:  # outputs cannot read them either: the reference, as below
                    pass
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
            _validate_on_cpu(op, args)  # the values, every call (see _validate_on_cpu)
            decision = _training_decision(op, impl, args, names)
            split = _split_of(decision.fn_for(args)) if uses_split else None
            saved = None
            with torch.no_grad(), _autocast_off(op, args):
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
                with torch.no_grad(), _autocast_off(op, args):
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
