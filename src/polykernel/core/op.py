"""The :class:`Op` object: one op's identity, semantics hooks and its per-call hot path.

An op module (``polykernel/ops/<name>.py``) builds one ``Op`` and a public function that hands
its arguments to :meth:`Op.dispatch`, which recognises a repeat of a recent *argument class* (the
small tuple that decisions are memoized on) by its guard, and otherwise builds the class, validates
the arguments once per new class and decides (see :class:`Op`). Everything slow (resolution order,
explain records, fallbacks) lives in :mod:`polykernel.core.selection` and runs once per new key.
"""

from __future__ import annotations

import inspect
import operator
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch

from .. import _compat
from ..errors import OpArgumentError, OpTypeError, shown
from ..spec import KernelSpec
from . import codegen, hit_guard, hooks, memo_key, registry
from . import selection as _dispatch
from .errormodel import SUM_LAMBDA, TINY, UNIT_ROUNDOFF, Bounds, ErrorModel, Tol, compute_dtype  # noqa: F401 (re-exported)
from .memo_key import MemoKey


def rows_and_len(x: torch.Tensor) -> tuple[int, int]:
    """(rows, n) of a tensor reduced over its last dim."""
    n = x.shape[-1] if x.dim() else 1
    return (x.numel() // n if n else 0), n


@dataclass(frozen=True)
class Case:
    """One parity case: positional args, keyword args and a label for test ids."""

    label: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)


class ArgClass:
    """Named, read-only view of an argument-class tuple, handed to spec predicates."""

    __slots__ = ("_fields", "_values")

    def __init__(self, fields: Sequence[str], values: Sequence[Any]) -> None:
        self._fields = tuple(fields)
        self._values = tuple(values)

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[self._fields.index(name)]
        except ValueError:
            raise AttributeError(name) from None

    def as_dict(self) -> dict[str, Any]:
        return dict(zip(self._fields, self._values))

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v}" for k, v in self.as_dict().items())
        return f"ArgClass({inner})"


# torch.are_deterministic_algorithms_enabled's C function where there is one (polykernel._compat).
_deterministic = _compat.deterministic_enabled
_grad_enabled = torch.is_grad_enabled


_compiling = _compat.is_compiling
_inference_mode = torch.is_inference_mode_enabled
_increment_version = torch.autograd.graph.increment_version


def _mark_written(tensors: Sequence[torch.Tensor]) -> None:
    """Bump the version counter of each tensor an op wrote, as torch's in-place ops do, so that a
    backward which saved one of them before the write raises instead of using the new values. A
    torch impl's own in-place ops have bumped them already: a second bump is harmless (autograd
    compares versions for equality). Inference tensors have no counter."""
    for t in tensors:
        if not t.is_inference():
            _increment_version(t)


# The generated hot path (see _hot_dispatch) inlines `is_compiling` where this torch allows (one Python
# frame instead of two): the expression and the names it reads are polykernel._compat's.
_COMPILING_EXPR = _compat.COMPILING_EXPR
# torch.cuda.is_current_stream_capturing's C function where there is one; asked only for
# decisions on CUDA devices.
_stream_capturing = _compat.stream_capturing


# -- the tensor-subclass guard ---------------------------------------------------------------
# An impl that reads raw memory (Triton, CuTe, peers) must never be handed a tensor subclass: a
# DTensor has no storage of its own, a wrapper subclass's memory is not what it stands for. The
# hot path asks, only when the memoized impl reads raw memory, whether every tensor argument is a
# plain torch.Tensor or nn.Parameter; the op's tensor positions come from its reference's
# signature, and the check is generated code (~25 ns per tensor; a loop or map costs ~3x more).

_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter, type(None)})


def _mentions_tensor(tp: Any) -> bool:
    if isinstance(tp, type) and issubclass(tp, torch.Tensor):
        return True
    return any(_mentions_tensor(a) for a in typing.get_args(tp))


def _tensor_positions(reference: Callable[..., Any]) -> tuple[int, ...]:
    """Positional parameters of ``reference`` that may hold a tensor (annotated so, or not
    annotated and without a non-None default)."""
    try:
        hints = typing.get_type_hints(reference)
    except Exception:  # unresolvable annotations: every parameter without a scalar default
        hints = {}
    out = []
    for i, p in enumerate(inspect.signature(reference).parameters.values()):
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            break
        tp = hints.get(p.name)
        if tp is not None:
            if _mentions_tensor(tp):
                out.append(i)
        elif p.default is p.empty or p.default is None:
            out.append(i)
    return tuple(out)


def plain_check(reference: Callable[..., Any]) -> Callable[[tuple[Any, ...]], bool]:
    """``check(args)``: True when the arguments at the reference's tensor positions are plain
    tensors (or None). False sends the call to the slow path, which looks at every argument
    (:func:`polykernel.core.selection.subclass_name`), so a false alarm only costs time."""
    positions = _tensor_positions(reference)
    if not positions:
        return lambda args: True
    body = " and ".join(f"type(a[{i}]) in P" for i in positions)
    namespace: dict[str, Any] = {"P": _PLAIN}
    src = f"def check(a):\n    try:\n        return {body}\n    except IndexError:\n        return False\n"
    return codegen.define(src, f"<polykernel subclass check: {reference.__module__}.{reference.__qualname__}>", "check", namespace)


# How many guarded decisions Op.dispatch tries per call, most recent first: a model may alternate
# a few classes per op (DeepSeek-V3's norms of three widths, grad mode on and off); a class after
# them costs its argument class in Python (the slow path) plus ~0.1 µs per failed guard.
FAST_RECORDS = 4


def _run_tail(args: str, plain: str) -> str:
    """The generated hot paths' end: the decision ``d``'s two rare guards, then the impl."""
    return (
        f"    if d.guarded:\n"
        f"        if d.cuda and capturing():\n"
        f"            d = op._captured(d.key, ({args},))\n"
        f"        if d.raw and not ({plain}):\n"
        f"            d = op._subclass(d.key, ({args},), d)\n"
        f"    try:\n"
        f"        return d.fn({args})\n"
        f"    except Exception as exc:\n"
        f"        return d.on_fault(exc, ({args},))\n"
    )


def _exec(op: Op, src: str, name: str) -> Callable[..., Any]:
    """The function ``name`` defined by the generated ``src``, documented as the Op method it replaces."""
    namespace: dict[str, Any] = {
        "DEFAULTS": [p.default for p in inspect.signature(op.reference).parameters.values()],
        "P": _PLAIN,
        "op": op,
        "slow": op._dispatch_slow,
        "key": op.key,
        "call": op.call,
        "compiling": _compiling,
        "dynamo_compiling": _compat.dynamo_compiling,
        "compiler_mod": torch.compiler,
        "scope_get": _scope_get,
        "det": _deterministic,
        "grad": _grad_enabled,
        "capturing": _stream_capturing,
        "fast": op._fast,
        "same_items": _same_items,
        "memo_get": op._memo.get,  # the memo dict lives as long as the op (cleared, never replaced)
    }
    fn = codegen.define(src, f"<polykernel hot path: {op.id}.{name}>", name, namespace)
    fn.__doc__ = getattr(Op, name).__doc__
    return fn


# The exact types an option annotated so may have: an int is a float's value too, a bool never.
_OPTION_TYPES: dict[Any, frozenset[type]] = {
    float: frozenset({float, int}),
    int: frozenset({int}),
    str: frozenset({str}),
    bool: frozenset({bool}),
}


class OptionType(typing.NamedTuple):
    """The exact types an option may have, and for a sequence option (``list[int]``) its items'."""

    types: frozenset[type]
    items: frozenset[type] | None = None

    def admits(self, value: Any) -> bool:
        return type(value) in self.types and (
            self.items is None or not isinstance(value, (list, tuple)) or all(type(v) in self.items for v in value)
        )

    def expected(self) -> str:
        names = " or ".join(sorted("None" if t is type(None) else t.__name__ for t in self.types))
        if self.items is not None:
            return f"{names} of {' or '.join(sorted(t.__name__ for t in self.items))}"
        return f"a {names}" if len(self.types) == 1 else names  # "a bool", as the ops' own checks say


def _option_types(reference: Callable[..., Any], positions: Sequence[int]) -> tuple[OptionType | None, ...]:
    """Per option position, the types its annotation in ``reference`` allows (None: unchecked).
    An unannotated parameter whose default is a bool (``average_log_prob=False``) is a bool
    option: a string or an int there must never pass for a truth value."""
    try:
        hints = typing.get_type_hints(reference)
    except Exception:  # unresolvable annotations: options unchecked here (validate still runs)
        hints = {}
    params = list(inspect.signature(reference).parameters.values())
    out: list[OptionType | None] = []
    for i in positions:
        tp = hints.get(params[i].name) if i < len(params) else None
        if tp is None and i < len(params) and isinstance(params[i].default, bool):
            tp = bool
        args = typing.get_args(tp)
        origin = typing.get_origin(tp)
        if tp in _OPTION_TYPES:
            out.append(OptionType(_OPTION_TYPES[tp]))
        elif isinstance(origin, type) and issubclass(origin, Sequence):  # list[int]: a list or tuple (of ints)
            items = _OPTION_TYPES.get(args[0]) if len(args) == 1 else None
            out.append(OptionType(frozenset({list, tuple}), items))
        elif args and all(a in _OPTION_TYPES or a is type(None) for a in args):  # float | None
            out.append(OptionType(frozenset().union(*(_OPTION_TYPES.get(a, frozenset({a})) for a in args))))
        else:
            out.append(None)
    return tuple(out)


def _same_items(a: Any, b: Any) -> bool:
    """Whether two equal sequence options hold items of the same types (``[2.0, 1, 1] == [2, 1, 1]``)."""
    return all(type(x) is type(y) for x, y in zip(a, b))


def _picker(positions: Sequence[int]) -> Callable[[Sequence[Any]], tuple[Any, ...]]:
    """``pick(args)``: the tuple of ``args`` at ``positions`` (itemgetter: no Python frame)."""
    if len(positions) >= 2:
        return operator.itemgetter(*positions)
    if positions:
        (i,) = positions
        return lambda args: (args[i],)
    return lambda args: ()


def _hot_dispatch(op: Op) -> Callable[..., Any]:
    """``op.dispatch`` as code generated for the op's arity and guard spec (see
    :mod:`polykernel.core.hit_guard`): the public function hands over the impl's arguments as they
    came, and a call whose tensors pass the guard of one of the last few decisions (most recent
    first, ``FAST_RECORDS``), with the same options, grad mode, impl, scope and deterministic
    flag, runs that decision without building its argument class (~0.4 µs less than
    :meth:`Op.call`). Any other call takes :meth:`Op._dispatch_slow`: the class from
    ``op.key``, then ``Op.call``'s logic, and that decision's guard for the next calls.
    """
    spec = op.guard
    params = [p for p in inspect.signature(op.reference).parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if spec is None:
        return op._dispatch_slow_star
    if len(spec) != len(params):
        raise ValueError(f"{op.id}: guard has {len(spec)} entries, the reference {len(params)} positional parameters")
    names = [f"a{i}" for i in range(len(params))]
    # an argument left out takes the reference's default (the public functions pass them all)
    sig = ", ".join(n if p.default is p.empty else f"{n}=DEFAULTS[{i}]" for i, (n, p) in enumerate(zip(names, params)))
    args = ", ".join(names)
    if not hit_guard.available():  # no guard in this torch: every call takes the slow path, whose
        # checks (option types, inference tensors) the guard's records otherwise stand for
        src = (
            f"def dispatch(impl, {sig}):\n"
            f"    if {_COMPILING_EXPR}:\n"
            f"        return op.custom_op(impl, {args})\n"
            f"    return slow(impl, ({args},), scope_get(), det(), grad())\n"
        )
        return _exec(op, src, "dispatch")
    plain = " and ".join(f"type(a{i}) in P" for i in _tensor_positions(op.reference) if i < len(names)) or "True"
    tensors = ", ".join(names[i] for i in hit_guard.tensor_positions(spec))
    options = [names[i] for i, kind in enumerate(spec) if kind is None]
    # impl: identity first (None, a literal), == for an equal string built at run time
    # grad mode: None in a record whose tensors all have requires_grad False (the guard pins it),
    # where the class does not depend on it: inference calls skip reading it
    test = f"(impl is f[2] or impl == f[2]) and scope is f[3] and dt is f[4] and (f[1] is None or grad() is f[1]) and f[0]({tensors})"
    test += "".join(f" and {names[i]}.shape == {names[j]}.shape" for i, j in hit_guard.relations(spec))
    # options: the same object (a default, a literal: one `is`), else the same type and equal, so
    # that False never passes for 0.0, nor a tensor for a float (`tensor == 1e-6` is truthy)
    # a sequence option also needs its items' types: [2.0, 1, 1] == [2, 1, 1] must not reuse the
    # decision made (and validated) for the ints
    typed = _option_types(op.reference, [i for i, kind in enumerate(spec) if kind is None])
    test += "".join(
        f" and ({name} is f[{6 + k}] or (type({name}) is type(f[{6 + k}]) and {name} == f[{6 + k}]"
        + (f" and same_items({name}, f[{6 + k}])" if t is not None and t.items is not None else "")
        + "))"
        for k, (name, t) in enumerate(zip(options, typed))
    )
    src = (
        f"def dispatch(impl, {sig}):\n"
        f"    if {_COMPILING_EXPR}:\n"
        f"        return op.custom_op(impl, {args})\n"
        f"    scope = scope_get()\n"
        f"    dt = det()\n"
        f"    for f in fast:\n"
        f"        try:\n"
        f"            if {test}:\n"
        f"                break\n"
        f"        except Exception:  # an option that compares oddly (a tensor eps), a non-tensor\n"
        f"            pass\n"
        f"    else:\n"
        f"        return slow(impl, ({args},), scope, dt, grad())\n"
        f"    try:\n"
        f"        if f is not fast[0]:  # a class that alternates with others: tried first from now on\n"
        f"            fast.remove(f)\n"
        f"            fast.insert(0, f)\n"
        f"    except (ValueError, IndexError):  # another thread changed the list meanwhile\n"
        f"        pass\n"
        f"    d = f[5]\n"
        f"{_run_tail(args, plain)}"
    )
    return _exec(op, src, "dispatch")


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
      :func:`_mark_written`): it refuses what torch's in-place ops refuse and bumps each written
      tensor's version counter, so a backward that saved an overwritten tensor raises. A compiled
      call runs one mutating custom op (:mod:`polykernel.compile.library`), and first-use
      verification gives each side its own copies of the arguments (:mod:`polykernel.core.verify`).
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
        self.outputs = outputs
        self.guard = None if guard is None else tuple(guard)
        # The layers above read these; the core only keeps them (see the class docstring).
        self.compile_mode = compile_mode
        self.saved = None if saved is None else tuple(saved)
        self.saved_grads = saved_grads
        self.dtensor_layout = dtensor_layout
        self.writes = tuple(writes)
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
        """:meth:`dispatch` for a call the guard did not recognise (``scope``, ``det``, ``grad``:
        the state it read): the argument class from ``key``, the decision as :meth:`call` makes
        it, and that decision's guard for the next calls (built ~1 µs on the decision's first
        call, kept on the decision for when its class comes back). A call no guard can cover (a
        subclass, a non-tensor) leaves the last one in place."""
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
        if grad and _dispatch.saves_inference_tensor(self._guarded(args)):  # see selection.INFERENCE
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
        return self._finish(decision, key, args)

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
        """The tensors this call writes, after refusing, before anything is written, what torch's
        in-place ops refuse: an inference tensor outside inference mode (it has no version counter
        to bump), and a tensor that requires grad while grad mode is on (an in-place write of a
        leaf is an error in torch; the serving ops have no autograd to record one of a non-leaf)."""
        out = []
        for i, name in self._written:
            t = args[i] if i < len(args) else None
            if not isinstance(t, torch.Tensor):
                continue
            if t.is_inference() and not _inference_mode():
                raise OpArgumentError(
                    self.id,
                    name,
                    "is an inference tensor (made under torch.inference_mode()) and is written in place: "
                    "Inplace update to inference tensor outside InferenceMode is not allowed "
                    "(as in torch); call the op under torch.inference_mode(), or pass a clone() made outside it",
                )
            if t.requires_grad and _grad_enabled():
                leaf = "a leaf Variable that requires grad" if t.is_leaf else "a tensor that requires grad"
                raise OpArgumentError(
                    self.id,
                    name,
                    f"is {leaf} and is written in place, which autograd cannot record here "
                    "(call the op under torch.no_grad() or torch.inference_mode())",
                )
            out.append(t)
        return tuple(out)

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


_scope = _dispatch.SCOPE
_scope_get = _scope.get
