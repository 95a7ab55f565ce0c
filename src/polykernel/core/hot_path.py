"""The hot path of :meth:`polykernel.core.op.Op.dispatch`: code generated per op for its arity and
guard spec (:func:`_hot_dispatch`), the tensor-subclass check (:func:`plain_check`) and the option
types the slow path checks (:func:`_option_types`). ``polykernel.core.op`` re-exports the names it
used to define here.

``_hot_dispatch`` is the one generated function of the dispatcher's per-call path: the same logic
as an ordinary closure, written for speed (``plain_dispatch`` in
``benchmarks/host/plain_vs_generated.py``), costs more per call, most where an op has options or
shape relations to compare (``benchmarks/results/cpu-2026-12-03-plain-dispatch/``). The
generated source is registered with linecache: tracebacks show it and pdb steps through it."""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .. import _compat
from . import codegen, hit_guard
from . import selection as _dispatch
from .writes import mark_written as _mark_written

if TYPE_CHECKING:
    from .protocols import HotPathOp

# torch.are_deterministic_algorithms_enabled's C function where there is one (polykernel._compat).
_deterministic = _compat.deterministic_enabled
_grad_enabled = torch.is_grad_enabled


_compiling = _compat.is_compiling

# The generated hot path (see _hot_dispatch) inlines `is_compiling` where this torch allows (one Python
# frame instead of two): the expression and the names it reads are polykernel._compat's.
_COMPILING_EXPR = _compat.COMPILING_EXPR
# ... where a guard stands before the impl, only Dynamo's check: under Dynamo the generated code is
# traced, not run, and must reach the custom op before the guard (a C call Dynamo cannot trace).
# The rest of a compile that runs this code (non-strict export, and in newer torch anything inside a
# compile session) hands it fake or functional tensors, which no guard accepts (a subclass): the
# slow path asks the whole check (Op._dispatch_slow). ~20 ns a call (benchmarks/results/cpu-2026-12-05-hot-path/).
_TRACING_EXPR = "dynamo_compiling()" if _COMPILING_EXPR != "compiling()" else _COMPILING_EXPR  # (its probe's fallback)
# ... and the check that a forward-AD dual level is open (then Op.forward_ad looks at the tensors).
_FORWARD_AD_EXPR = _compat.FORWARD_AD_EXPR
# torch.cuda.is_current_stream_capturing's C function where there is one; asked only for
# decisions on CUDA devices.
_stream_capturing = _compat.stream_capturing


# -- the tensor-subclass guard ---------------------------------------------------------------
# An impl that reads raw memory (Triton, CuTe, peers) must never be handed a tensor subclass: a
# DTensor has no storage of its own, a wrapper subclass's memory is not what it stands for. The
# hot path asks, only when the memoized impl reads raw memory, whether every tensor argument is a
# plain torch.Tensor or nn.Parameter; the op's tensor positions come from its reference's
# signature; the hot path inlines it in its generated code, the slow path calls :func:`plain_check`.

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
    (:func:`polykernel.core.selection.subclass_name`), so a false alarm only costs time; so does a
    call with fewer arguments than those positions."""
    positions = _tensor_positions(reference)
    if not positions:
        return lambda args: True
    last, pick, plain = positions[-1], _picker(positions), _PLAIN.issuperset

    def check(args: tuple[Any, ...]) -> bool:
        return len(args) > last and plain(map(type, pick(args)))

    return check


# How many guarded decisions Op.dispatch tries per call, most recent first: a model may alternate
# a few classes per op (DeepSeek-V3's norms of three widths, grad mode on and off); a class after
# them costs its argument class in Python (the slow path) plus ~0.1 µs per failed guard.
FAST_RECORDS = 4


def _run_tail(args: str, plain: str | None, written: str = "") -> str:
    """The generated hot paths' end: the decision ``d``'s rare guards, then the impl; for an op
    that writes its arguments (``written``: those argument names), their version bumps after it
    (:func:`polykernel.core.writes.mark_written`; also after a fault, which may have written part).
    ``plain``: the subclass check of the tensor arguments the record's guard does not cover (None:
    it covers them all; TensorGuards compares each tensor's exact type, and records are built from
    plain tensors only, so a hit's tensors are plain: ~0.08 µs less per call of an impl that reads
    raw memory, ``benchmarks/results/h200-2026-12-05-thirteenth/``)."""
    if plain is None:
        guards = f"    if d.cuda and capturing():\n        d = op._captured(d.key, ({args},))\n"
    else:
        guards = (
            f"    if d.guarded:\n"
            f"        if d.cuda and capturing():\n"
            f"            d = op._captured(d.key, ({args},))\n"
            f"        if d.raw and not ({plain}):\n"
            f"            d = op._subclass(d.key, ({args},), d)\n"
        )
    return (
        guards + f"    try:\n"
        f"        return d.fn({args})\n"
        f"    except Exception as exc:\n"
        f"        return d.on_fault(exc, ({args},))\n" + (f"    finally:\n        mark_written(({written}))\n" if written else "")
    )


def _exec(op: HotPathOp, src: str, name: str) -> Callable[..., Any]:
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
        "fwad": torch.autograd.forward_ad,
        "forward_ad_open": _compat.forward_ad_open,
        "scope_get": _scope_get,
        "det": _deterministic,
        "grad": _grad_enabled,
        "capturing": _stream_capturing,
        "fast": op._fast,
        "same_items": _same_items,
        "memo_get": op._memo.get,  # the memo dict lives as long as the op (cleared, never replaced)
        "mark_written": _mark_written,
    }
    fn = codegen.define(src, f"<polykernel hot path: {op.id}.{name}>", name, namespace)
    fn.__doc__ = getattr(type(op), name).__doc__
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


_picker = hit_guard.picker


def _hot_dispatch(op: HotPathOp) -> Callable[..., Any]:
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
            f"    if {_FORWARD_AD_EXPR}:\n"
            f"        return op.forward_ad(impl, ({args},))\n"
            f"    return slow(impl, ({args},), scope_get(), det(), grad())\n"
        )
        return _exec(op, src, "dispatch")
    guarded = hit_guard.tensor_positions(spec)
    # the subclass check of the tail: only tensor arguments the guard does not see (see _run_tail)
    plain = " and ".join(f"type(a{i}) in P" for i in _tensor_positions(op.reference) if i < len(names) and i not in guarded) or None
    tensors = ", ".join(names[i] for i in guarded)
    options = [names[i] for i, kind in enumerate(spec) if kind is None]
    # impl: identity first (None, a literal), == for an equal string built at run time
    # grad mode: None in a record whose tensors all have requires_grad False (the guard pins it),
    # where the class does not depend on it: inference calls skip reading it
    test = f"(impl is f[2] or impl == f[2]) and SCOPE is f[3] and DET is f[4] and (f[1] is None or grad() is f[1]) and f[0]({tensors})"
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
    # the most recent record first, outside the loop (a repeat of the last class, the usual call,
    # creates no iterator: ~15 ns), with the scope and deterministic flag read in the test itself
    # (~10 ns less on Python 3.12 than through locals: benchmarks/results/h200-2026-12-05-thirteenth/);
    # then the others
    first = test.replace("SCOPE", "scope_get()").replace("DET", "det()")
    others = test.replace("SCOPE", "scope").replace("DET", "dt")
    src = (
        f"def dispatch(impl, {sig}):\n"
        f"    if {_TRACING_EXPR}:\n"
        f"        return op.custom_op(impl, {args})\n"
        f"    if {_FORWARD_AD_EXPR}:  # dual tensors: their tangents (see Op.forward_ad)\n"
        f"        return op.forward_ad(impl, ({args},))\n"
        f"    try:\n"
        f"        f = fast[0]\n"
        f"        miss = not ({first})\n"
        f"    except Exception:  # no record yet, an option that compares oddly (a tensor eps), a non-tensor\n"
        f"        miss = True\n"
        f"    if miss:\n"
        f"        scope = scope_get()\n"
        f"        dt = det()\n"
        f"        for f in fast[1:]:\n"
        f"            try:\n"
        f"                if {others}:\n"
        f"                    break\n"
        f"            except Exception:\n"
        f"                pass\n"
        f"        else:\n"
        f"            return slow(impl, ({args},), scope, dt, grad())\n"
        f"        try:\n"
        f"            if f is not fast[0]:  # a class that alternates with others: tried first from now on\n"
        f"                fast.remove(f)\n"
        f"                fast.insert(0, f)\n"
        f"        except (ValueError, IndexError):  # another thread changed the list meanwhile\n"
        f"            pass\n"
        f"    d = f[5]\n"
        f"{_run_tail(args, plain, ''.join(f'{names[i]}, ' for i, _ in op._written))}"
    )
    return _exec(op, src, "dispatch")


_scope = _dispatch.SCOPE
_scope_get = _scope.get
