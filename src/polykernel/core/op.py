"""The :class:`Op` object: one op's identity, semantics hooks and its per-call hot path.

An op module (``polykernel/ops/<name>.py``) builds one ``Op`` and a public function that hands
its arguments to :meth:`Op.dispatch`, which recognises a repeat of a recent *argument class* (the
small tuple that decisions are memoized on) by its guard, and otherwise builds the class, validates
the arguments once per new class and decides (see :class:`Op`). Everything slow (resolution order,
explain records, fallbacks) lives in :mod:`polykernel.core.selection` and runs once per new key.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import torch

from .. import _compat
from ..errors import OpTypeError, shown
from ..spec import KernelSpec
from . import hit_guard, hooks, memo_key, registry
from . import selection as _dispatch
from .errormodel import SUM_LAMBDA, TINY, UNIT_ROUNDOFF, Bounds, ErrorModel, Tol, compute_dtype  # noqa: F401 (re-exported)
from .hot_path import (  # noqa: F401 (FAST_RECORDS, OptionType, _COMPILING_EXPR, _hot_dispatch: re-exported)
    _COMPILING_EXPR,
    FAST_RECORDS,
    OptionType,
    _compiling,
    _deterministic,
    _hot_dispatch,
    _option_types,
    _picker,
    _scope_get,
    _stream_capturing,
    plain_check,
)
from .memo_key import MemoKey
from .values import ArgClass, Case, rows_and_len  # noqa: F401 (re-exported)
from .writes import mark_written as _mark_written
from .writes import writable as _writable

_forward_ad_open = _compat.forward_ad_open
_grad_enabled = torch.is_grad_enabled
_unpack_dual = torch.autograd.forward_ad.unpack_dual
_NO_KEY = object()  # Op.forward_ad called without an argument class (the hot path builds none)


def _has_tangent(args: Sequence[Any]) -> bool:
    """Whether a tensor among ``args`` (or in a list or tuple there) carries a forward-AD tangent."""
    for a in args:
        if isinstance(a, torch.Tensor):
            if _unpack_dual(a).tangent is not None:
                return True
        elif isinstance(a, (list, tuple)) and _has_tangent(a):
            return True
    return False


class Op:
    """An op: id, argument-class fields, reference, error model, examples and parity cases.

    Every op has one form (``polykernel/ops/rms_norm.py`` reads as the model):

    - the public function passes its arguments, positionally in the reference's order, to
      :meth:`dispatch` (``_dispatch = _op.dispatch``, bound once), and does nothing else on the
      hot path;
    - ``key(*args)`` builds the *argument class*: ``fields`` names its entries, which always start
      with ``"device"``, ``"dtype"``, ``"needs_grad"``. It must hold everything validity depends on:
      dtypes, devices, the sizes that are checked, the options, and relations between arguments
      as flags (``up_matches``: up has gate's shape, dtype and device), so that two calls of one
      class are both valid or both invalid. It may raise on arguments it cannot read (a
      non-tensor, a 0-d tensor where rows are needed): ``validate`` then names the problem;
    - ``validate(*args)`` runs once per new class, on the memo miss, and raises the error that
      names the op and the argument (so a bad call is rejected on every repeat too: its class is
      never memoized). Validity that depends on the data itself (the losses' target range on the
      CPU) cannot be memoized: the public function validates every such call itself;
    - ``guard``: per positional argument of the reference, what the class holds of it
      (:mod:`polykernel.core.hit_guard`: ``LAST``, ``SHAPE``, ``dims(...)``, the index of a tensor
      whose shape it must equal, or None for an option). A repeat of one of the last few decisions'
      classes is recognised by one C call over the tensors' metadata instead of building the
      class; anything else takes the slow path (``key``, the memo, ``validate`` on a miss).

    ``default_key(device, dtype)`` builds a class for ``explain``/``available_impls`` when no
    arguments are given (unknown sizes are None). :meth:`call` takes a class built by the caller
    (the DTensor route and the compiled path use it).

    ``outputs`` (optional) gives, from the impl's positional arguments, the ``(shape, dtype)`` of
    each output: the first call of each decision checks an impl's outputs against it
    (:mod:`polykernel.core.first_call`). Without it, the reference runs on meta tensors, which imports
    ``torch._dynamo`` (and with it ``torch.distributed.tensor``, ~1 s) on the first call: torch's
    Python meta kernels sit behind ``torch._disable_dynamo``.

    The op's facts for the layers above the core, which the core only stores:

    - ``compile_mode``: under ``torch.compile``, ``"ours"`` (the op's custom ops run the
      dispatcher's impl) or ``"decompose"`` (Inductor traces the reference and fuses it);
      ``POLYKERNEL_COMPILE_<OP>`` overrides it (:mod:`polykernel.compile.library`);
    - ``saved``: the kinds of the tensors its compiled training step saves for the backward, or
      None to save nothing and recompute (:mod:`polykernel.compile.facts`);
    - ``saved_grads``: a :class:`polykernel.compile.facts.SavedGrads` when those saved tensors are
      the finished gradients for some calls, else None;
    - ``dtensor_layout``: a :class:`polykernel.distributed.layout.Layout` saying how DTensor
      arguments may be placed to run on their local shards, or None (DTensor's own rules on the
      torch impl);
    - ``writes``: the names of the reference's parameters that the op writes into (its
      destinations: the serving ops' ``out`` and in-place arguments, always tensors when the
      impls run). The reference and every impl write their results into those tensors and return
      them, in the order of ``writes``; such an op is inference only (no autograd). Whatever the
      impl, :meth:`run` makes the write one of torch's in-place ops to autograd (:meth:`_writable`,
      :func:`polykernel.core.writes.mark_written`): it refuses what torch's in-place ops refuse and bumps each written
      tensor's version counter, so a backward that saved an overwritten tensor raises. A compiled
      call runs one mutating custom op (:mod:`polykernel.compile.library`), and first-use
      verification gives each side its own copies of the arguments (:mod:`polykernel.core.verify`).
    - ``validate_each_call``: ``validate`` runs on every call the guard does not recognise, not
      once per class: for an op whose class does not hold every fact its validity depends on
      (the serving ops: a destination's shape and dtype, a scale's shape). A call the guard
      recognises has the metadata and options of a validated call; what validity reads beyond
      them (memory: overlaps, strides; values), the public function checks on every call, before
      ``dispatch``. (:meth:`call` and :meth:`run` take arguments their caller validated.)
    - ``bench_shapes``: ``(label, shape)`` pairs for ``example``, the shapes ``polykernel bench``
      and ``polykernel tune`` use for an op without README shapes of its own
      (:data:`polykernel.tools.bench_shapes.SHAPES`): a new op benches with no list to edit.
    - ``autocast``: for an op whose impls cast their arguments under ``torch.autocast`` (the fused
      linear ops: ``polykernel.ops._autocast``), the arguments as they cast them; a compiled
      call applies it at trace time, since the custom op runs with autocast off.
    """

    def __init__(
        self,
        id: str,
        *,
        fields: Sequence[str],
        key: Callable[..., tuple[Any, ...]],
        default_key: Callable[[torch.device, torch.dtype], tuple[Any, ...]],
        reference: Callable[..., Any],
        error_model: Callable[..., Bounds],
        dtypes: Sequence[torch.dtype],
        cases: Callable[[torch.device, torch.dtype], list[Case]],
        example: Callable[..., Case],
        bytes_moved: Callable[..., int] | None = None,
        impls: Sequence[KernelSpec] = (),
        validate: Callable[..., None] | None = None,
        outputs: Callable[..., Sequence[tuple[Sequence[int], torch.dtype]]] | None = None,
        guard: hit_guard.GuardSpec | None = None,
        compile_mode: str = "ours",
        saved: Sequence[str] | None = None,
        saved_grads: Any = None,
        dtensor_layout: Any = None,
        writes: Sequence[str] = (),
        validate_each_call: bool = False,
        bench_shapes: Sequence[tuple[str, tuple[int, ...]]] = (),
        autocast: Callable[[tuple[Any, ...]], tuple[Any, ...]] | None = None,
    ) -> None:
        if tuple(fields[:3]) != ("device", "dtype", "needs_grad"):
            raise ValueError("Op fields must start with device, dtype, needs_grad")
        self.id = id
        self.name = id.rpartition(".")[2]
        self.fields = tuple(fields)
        self.key = key
        self.default_key = default_key
        self.reference = reference
        self.error_model = error_model
        self.dtypes = tuple(dtypes)
        self.cases = cases
        self.example = example
        self.bytes_moved = bytes_moved
        self.validate = validate
        self.validate_each_call = validate_each_call
        self.outputs = outputs
        self.guard = None if guard is None else tuple(guard)
        # The layers above read these; the core only keeps them (see the class docstring).
        self.compile_mode = compile_mode
        self.saved = None if saved is None else tuple(saved)
        self.saved_grads = saved_grads
        self.dtensor_layout = dtensor_layout
        self.writes = tuple(writes)
        self.bench_shapes = tuple((label, tuple(shape)) for label, shape in bench_shapes)
        self.autocast = autocast
        params = list(inspect.signature(reference).parameters)
        unknown = set(self.writes) - set(params)
        if unknown:
            raise ValueError(f"{id}: writes names {sorted(unknown)}, which are not parameters of its reference")
        self._written = tuple((params.index(w), w) for w in self.writes)  # (position, name) of each destination
        if self.guard is not None:  # the slow path's views of a call: the guarded tensors, the options
            self._guarded = _picker(hit_guard.tensor_positions(self.guard))
            option_positions = tuple(i for i, kind in enumerate(self.guard) if kind is None)
            self._options = _picker(option_positions)
        names = list(inspect.signature(reference).parameters)
        # The options checked by type on the slow path (_mistyped), which every call the guard does
        # not recognise takes (an op without a guard: every call): the guard's options, else every
        # parameter its annotation (or a bool default) types. A new op's bool options are so
        # checked without code of its own.
        positions = option_positions if self.guard is not None else range(len(names))
        self._typed = [(i, names[i], t) for i, t in zip(positions, _option_types(reference, positions)) if t is not None]
        self._memo: dict[tuple[Any, ...], Any] = {}
        # The decisions :meth:`dispatch` recognises by their guards (see _hot_dispatch), most
        # recent first: (check, grad mode or None, impl, scope, deterministic, decision, *options).
        self._fast: list[tuple[Any, ...]] = []
        self._plain = plain_check(reference)
        self.dispatch = _hot_dispatch(self)  # type: ignore[method-assign]  # generated (see _hot_dispatch)
        registry.add_op(self, impls)

    def __repr__(self) -> str:
        return f"Op({self.id!r})"

    # -- hot path -------------------------------------------------------------------------
    # One template: `Op.__init__` replaces `dispatch` on the instance by code generated for the
    # op's arity and guard (see `_hot_dispatch`, registered with linecache: tracebacks and pdb
    # show it). A call its guards do not recognise takes `_dispatch_slow`, then `call`/`run`,
    # the one slow path (also the compiled custom ops' and DTensor shards' entry).
    def call(self, impl: str | None, argkey: tuple[Any, ...] | None, *args: Any) -> Any:
        """Run the impl chosen for ``argkey`` on ``args`` (positional, in the impl's order)."""
        if _compiling():  # under torch.compile: the op's torch.library custom op (no graph break)
            return self.custom_op(impl, *args)
        return self.run(impl, argkey, *args)

    def dispatch(self, impl: str | None, *args: Any) -> Any:
        """Run the impl chosen for ``args`` (positional, in the impl's order): :meth:`call` with
        the argument class computed here, by ``key`` when the guard does not recognise the call."""
        return self._dispatch_slow_star(impl, *args)  # replaced per instance (see _hot_dispatch)

    def _dispatch_slow_star(self, impl: str | None, *args: Any) -> Any:
        return self._dispatch_slow(impl, args)

    def _dispatch_slow(self, impl: str | None, args: tuple[Any, ...], scope: Any = None, det: Any = None, grad: Any = None) -> Any:
        """:meth:`_decide_and_guard`, for an op that writes its arguments between :meth:`_writable`'s
        refusals and the version bumps (as :meth:`_run_writing`; its guarded repeats bump only:
        what the refusals read, the guard pins). A compile's calls that Dynamo does not trace
        come here (see hot_path._TRACING_EXPR): the op's custom op."""
        if _compiling():
            return self.custom_op(impl, *args)
        if not self._written or grad is None:  # grad None: Op.call's path, which does both itself
            return self._decide_and_guard(impl, args, scope, det, grad)
        written = self._writable(args)
        try:
            return self._decide_and_guard(impl, args, scope, det, grad)
        finally:  # also after a fault: the impl may have written part of its destinations
            _mark_written(written)

    def _decide_and_guard(self, impl: str | None, args: tuple[Any, ...], scope: Any = None, det: Any = None, grad: Any = None) -> Any:
        """:meth:`dispatch` for a call the guard did not recognise (``scope``, ``det``, ``grad``:
        the state it read): the argument class from ``key``, the decision as :meth:`call` makes
        it, and that decision's guard for the next calls (built ~1 µs on the decision's first
        call, kept on the decision for when its class comes back). A call no guard can cover (a
        subclass, a non-tensor) leaves the last one in place."""
        if self.validate_each_call and self.validate is not None:  # first: its errors, as the op has always named them
            self.validate(*args)
        wrong = self._mistyped(args)  # before the memo, whose keys hold False == 0.0 alike
        if wrong is not None:
            self._reject(args, wrong)
        try:
            argkey = self.key(*args)
        except Exception:  # not tensors, 0-d x, an unhashable option: validate() names the problem
            argkey = None
        if grad is None or len(args) != len(self.guard):  # type: ignore[arg-type]
            return self.call(impl, argkey, *args)
        key = memo_key.make((argkey, impl, scope, det, False, None))
        if grad and self.inference_call(args):  # see selection.INFERENCE
            key = key._replace(subclass=_dispatch.INFERENCE)
            return self._finish(self._memo.get(key) or self._miss(key, args), key, args)
        try:
            decision = self._memo.get(key) or self._miss(key, args)
        except TypeError as exc:  # an unhashable option (eps=[1e-6]): validate names it
            return self._unhashable(exc, impl, argkey, args)
        check = decision.check
        if check is None or not check(*self._guarded(args)):  # none yet, or it does not fit (dims, type)
            check = hit_guard.build(self.guard, args)  # type: ignore[arg-type]
            if check is not None:  # (a call no guard covers keeps the decision's last one)
                decision.check = check
        if check is not None:
            if not any(t is not None and t.requires_grad for t in self._guarded(args)):
                grad = None  # the class does not depend on grad mode (see _hot_dispatch)
            fast = self._fast  # the generated code holds this list: changed in place
            fast.insert(0, (check, grad, impl, scope, det, decision, *self._options(args)))
            del fast[FAST_RECORDS:]
            if decision.generation != _dispatch.generation(self.id):  # stale (see selection.decide): not kept
                fast.clear()
        return self._finish(decision, key, args)

    def inference_call(self, args: tuple[Any, ...]) -> bool:
        """Whether a call with ``args`` (all of them, in the reference's order) is decided under
        ``selection.INFERENCE``: the guarded path's check (an op without a guard never is), which
        ``explain`` asks too, so that it names the impl such a call runs."""
        if self.guard is None or len(args) != len(self.guard) or not _grad_enabled():
            return False
        return _dispatch.saves_inference_tensor(self._guarded(args))

    def _mistyped(self, args: tuple[Any, ...]) -> OpTypeError | None:
        """The error naming the first option whose type its annotation does not allow (a bool is
        no float, a string no bool, a tensor no number), else None: the memo compares options with
        ``==``, under which ``False == 0.0``, and a string is truthy."""
        for i, name, allowed in self._typed:
            if i < len(args) and not allowed.admits(args[i]):  # fewer arguments: validate names what is missing
                return OpTypeError(self.id, name, f"expected {allowed.expected()}, got {shown(args[i])} ({type(args[i]).__name__})")
        return None

    def run(self, impl: str | None, argkey: tuple[Any, ...] | None, *args: Any) -> Any:
        """The eager path of :meth:`call` without its compile check: the custom op's real impl
        runs this (a compile may be in progress around it, e.g. inductor constant folding)."""
        if _forward_ad_open():  # a dual level is open: the call's tangents (see forward_ad)
            return self.forward_ad(impl, args, argkey)
        return self._run(impl, argkey, args)

    def forward_ad(self, impl: str | None, args: tuple[Any, ...], argkey: Any = _NO_KEY) -> Any:
        """A call while a forward-AD dual level is open (``torch.autograd.forward_ad``). A dual
        tensor does not require grad, so its argument class says "no gradient", and an impl that
        reads raw memory (or a torch impl's no-grad path) returns outputs without tangents: a
        zero derivative, silently. A call with a tangent is validated and its ``impl=`` resolved
        as any call (named errors), then runs the op's reference, whose torch ops carry the
        tangents (or raise where torch has no forward-mode rule). A call without one, and an op
        that writes its arguments (inference only), takes the usual path."""
        if self._written or not _has_tangent(args):
            if argkey is _NO_KEY:  # from the hot path: its slow path, with the state it reads
                return self._dispatch_slow(impl, args, _scope_get(), _deterministic(), _grad_enabled())
            return self._run(impl, argkey, args)
        wrong = self._mistyped(args)  # as on the slow path: the memo's keys hold False == 0.0 alike
        if wrong is not None:
            self._reject(args, wrong)
        if argkey is _NO_KEY:  # from the hot path, which builds no class
            try:
                argkey = self.key(*args)
            except Exception:  # validate (on the miss below) names the problem
                argkey = None
        self.decision_for(impl, argkey, args)  # validation and impl= resolution; nothing runs
        return self.reference(*args)

    def _run(self, impl: str | None, argkey: tuple[Any, ...] | None, args: tuple[Any, ...]) -> Any:
        if self._written:  # an op that writes its arguments (the serving ops: not on the guarded hot path)
            return self._run_writing(impl, argkey, args)
        key = memo_key.make((argkey, impl, _scope_get(), _deterministic(), False, None))
        try:
            decision = self._memo.get(key) or self._miss(key, args)
        except TypeError as exc:  # an unhashable option (eps=[1e-6]): validate names it
            return self._unhashable(exc, impl, argkey, args)
        return self._finish(decision, key, args)

    def _run_writing(self, impl: str | None, argkey: tuple[Any, ...] | None, args: tuple[Any, ...]) -> Any:
        """:meth:`run` for an op with ``writes``: the write is one of torch's in-place ops to
        autograd whatever the impl (a kernel writing through a raw pointer is invisible to it)."""
        written = self._writable(args)
        key = memo_key.make((argkey, impl, _scope_get(), _deterministic(), False, None))
        try:
            try:
                decision = self._memo.get(key) or self._miss(key, args)
            except TypeError as exc:  # an unhashable option (eps=[1e-6]): validate names it
                return self._unhashable(exc, impl, argkey, args)
            return self._finish(decision, key, args)
        finally:  # also after a fault: the impl may have written part of its destinations
            _mark_written(written)

    def _writable(self, args: tuple[Any, ...]) -> tuple[torch.Tensor, ...]:
        """The tensors this call writes, after refusing what torch's in-place ops refuse
        (:func:`polykernel.core.writes.writable`)."""
        return _writable(self.id, self._written, args)

    def decision_for(self, impl: str | None, argkey: tuple[Any, ...], args: tuple[Any, ...]) -> Any:
        """The decision a call of this class would run, without running it (the compiled training
        ops ask it in their forward and their backward, so that both pick the same impl)."""
        key = memo_key.make((argkey, impl, _scope_get(), _deterministic(), False, None))
        decision = self._memo.get(key) or self._miss(key, args)
        return self._situated(decision, key, args)

    def _situated(self, decision: Any, key: MemoKey, args: tuple[Any, ...]) -> Any:
        """``decision``, or the one for this call's situation: a CUDA-graph capture, a subclass."""
        if decision.cuda and _stream_capturing():  # CUDA-graph capture: its own decision
            decision = self._captured(key, args)
        if decision.raw and not self._plain(args):  # the impl reads raw memory: no subclasses
            decision = self._subclass(decision.key, args, decision)
        return decision

    def _finish(self, decision: Any, key: MemoKey, args: tuple[Any, ...]) -> Any:
        decision = self._situated(decision, key, args)
        try:
            return decision.fn(*args)
        except Exception as exc:  # handed to the fault policy, which re-raises what is not its own
            return decision.on_fault(exc, args)

    def _unhashable(self, exc: TypeError, impl: Any, argkey: Any, args: tuple[Any, ...]) -> Any:
        if isinstance(impl, list):  # impl=["triton", "torch"]: the same as a tuple
            return self.run(tuple(impl), argkey, *args)
        self._reject(args, exc)

    def _captured(self, key: tuple[Any, ...], args: tuple[Any, ...]) -> Any:
        """The decision while a CUDA graph is captured: decided under the key with capturing
        True (only graph-safe impls). Off the hot path: eager calls never come here."""
        key = key._replace(capturing=True)
        return self._memo.get(key) or self._miss(key, args)

    def _miss(self, key: tuple[Any, ...], args: tuple[Any, ...]) -> Any:
        """First call for a key: validate once per argument class, then resolve and memoize."""
        if key.argclass is None:  # the public function could not build the class: validate says why
            self._reject(args)
        if self.validate is not None:
            self.validate(*args)
        subclass = _dispatch.subclass_name(args)
        if subclass == "DTensor" and self._dtensor(key) is not None:  # tensor parallel: the plain
            # decision (not measured on DTensors), which checks for subclasses, so the guard below
            # hands the DTensors to the route (see _subclass)
            return self._memo.get(key) or _dispatch.decide(self, key, for_dtensor=True)
        if subclass is not None:  # decided under its own key; the plain key stays unset
            key = key._replace(subclass=subclass)
            return self._memo.get(key) or _dispatch.decide(self, key, args)
        return _dispatch.decide(self, key, args)

    def _subclass(self, key: tuple[Any, ...], args: tuple[Any, ...], decision: Any) -> Any:
        """Slow path of the guard: the memoized impl reads raw memory and an argument may be a
        tensor subclass. Such calls are decided under the key plus the subclass's type name,
        where only impls with ``accepts_subclasses`` are eligible (or a strict choice raises)."""
        subclass = _dispatch.subclass_name(args)
        if subclass is None:  # a false alarm (e.g. a list argument): the plain decision stands
            return decision
        if subclass == "DTensor":
            route = self._dtensor(key)
            if route is not None:
                return route
        key = key._replace(subclass=subclass)
        return self._memo.get(key) or _dispatch.decide(self, key, args)

    def _dtensor(self, key: tuple[Any, ...]) -> Any:
        """DTensor arguments: per call, the op on the local shards, redistributed first where the
        placements need it (:mod:`polykernel.distributed.dtensor`, imported only once a DTensor is seen).
        None for an op without a row layout: DTensor's rules on the torch impl, as any subclass."""
        return hooks.require("dtensor_route")(self, key)  # None for an op without a row layout

    def _reject(self, args: tuple[Any, ...], exc: Exception | None = None) -> NoReturn:
        """Raise validation's error for ``args``; else ``exc``, the error that brought us here."""
        if self.validate is not None:
            self.validate(*args)
        if exc is not None:
            raise exc
        raise AssertionError(f"{self.id}: arguments rejected without a reason")

    def custom_op(self, impl: str | None, *args: Any) -> Any:
        """Call this op's ``torch.ops.polykernel.<name>`` custom op (built on first use)."""
        return hooks.require("compiled_call")(self)(impl, *args)

    def clear(self) -> None:
        self._fast.clear()
        self._memo.clear()

    def memoized(self, key: MemoKey) -> Any:
        """The decision memoized under ``key``, or None."""
        return self._memo.get(key)

    def remember(self, key: MemoKey, decision: Any) -> None:
        """Memoize ``decision`` under ``key`` (the selection layer does, once per new key)."""
        self._memo[key] = decision

    def forget(self, key: MemoKey) -> None:
        """Drop one memoized decision (a runtime fault moved on from it)."""
        self._fast.clear()
        self._memo.pop(key, None)

    def arg_class(self, argkey: tuple[Any, ...]) -> ArgClass:
        return ArgClass(self.fields, argkey)
