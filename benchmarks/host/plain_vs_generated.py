"""The dispatcher's per-call path in plain source against the code generated per op.

    PYTHONPATH=src python benchmarks/host/plain_vs_generated.py [--rounds 200] [--calls 200] [--json FILE]

``Op.dispatch`` is generated per op (``polykernel.core.hot_path._hot_dispatch``: a fixed arity,
each option compared inline). ``plain_dispatch`` below is the same logic as an ordinary closure
that a debugger and coverage follow, written for speed (C-level picks and identity tests). Both
run on the same op objects, interleaved, with each op's memoized impl swapped for a no-op, so the
difference is the dispatcher's Python alone:

- ``rms_norm(x, w)``: 2 tensors, 3 options (the figure of ``benchmarks/host/overhead.py``);
- ``swiglu(g, u)``: 2 tensors, one shape relation, no option;
- ``cross_entropy(logits, target)``: 3 tensor slots (the weight None), 5 options.

CPU tensors, one thread; each candidate reports its best round (the least disturbed one).
"""

from __future__ import annotations

import argparse
import inspect
import sys
from collections.abc import Callable
from operator import is_
from pathlib import Path
from typing import Any

import torch

import polykernel
from polykernel import _compat
from polykernel.core import hit_guard, registry
from polykernel.core.hot_path import (
    _COMPILING_EXPR,
    _compiling,
    _deterministic,
    _grad_enabled,
    _hot_dispatch,
    _option_types,
    _picker,
    _same_items,
    _scope_get,
    _stream_capturing,
)
from polykernel.core.op import Op
from polykernel.tools.rows import RowFile, announce

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import interleaved_best_us


class _NoFlag:
    """Stands for ``torch.compiler`` where its ``_is_compiling_flag`` is missing (polykernel._compat)."""

    _is_compiling_flag = False


def _compile_checks() -> tuple[Callable[[], bool], Any]:
    """``(fn, holder)``: a call is compiled when ``fn() or holder._is_compiling_flag`` (two cheap
    reads where this torch has the flag, else the public ``is_compiling``)."""
    if _COMPILING_EXPR == "compiling()":
        return _compiling, _NoFlag
    return _compat.dynamo_compiling, torch.compiler  # type: ignore[return-value]


def plain_dispatch(op: Op) -> Callable[..., Any]:
    """``op.dispatch`` as an ordinary closure: the same logic as the generated one, its options
    compared by a C-level identity test first, then by type and value."""
    spec = op.guard
    if spec is None:
        return op._dispatch_slow_star
    params = [p for p in inspect.signature(op.reference).parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(spec) != len(params):
        raise ValueError(f"{op.id}: guard has {len(spec)} entries, the reference {len(params)} positional parameters")
    arity = len(params)
    defaults = tuple(p.default for p in params)
    dyn, flag = _compile_checks()
    forward_ad_open = _compat.forward_ad_open
    custom_op, slow, scope_get, det, grad, capturing = (
        op.custom_op,
        op._dispatch_slow,
        _scope_get,
        _deterministic,
        _grad_enabled,
        _stream_capturing,
    )
    plain = op._plain

    def complete(args: tuple[Any, ...]) -> tuple[Any, ...]:
        # an argument left out takes the reference's default (the public functions pass them all)
        return args if len(args) >= arity else (*args, *defaults[len(args) :])

    if not hit_guard.available():  # no guard in this torch: every call takes the slow path

        def unguarded(impl: Any, *args: Any) -> Any:
            if dyn() or flag._is_compiling_flag:
                return custom_op(impl, *args)
            return slow(impl, complete(args), scope_get(), det(), grad())

        return unguarded

    fast = op._fast
    guarded = _picker(hit_guard.tensor_positions(spec))
    options = _picker([i for i, kind in enumerate(spec) if kind is None])
    related = hit_guard.relations(spec)
    typed = _option_types(op.reference, [i for i, kind in enumerate(spec) if kind is None])
    sequences = tuple(k for k, t in enumerate(typed) if t is not None and t.items is not None)

    def same_options(opts: tuple[Any, ...], rec: tuple[Any, ...]) -> bool:
        # the same object, else the same type and equal: False never passes for 0.0, nor a tensor
        # for a float; a sequence option also needs its items' types ([2.0, 1] is not [2, 1])
        for a, b in zip(opts, rec):
            if a is not b and (type(a) is not type(b) or not a == b):
                return False
        for k in sequences:
            if not _same_items(opts[k], rec[k]):
                return False
        return True

    def hit(f: tuple[Any, ...], impl: Any, args: tuple[Any, ...], scope: Any, dt: bool) -> bool:
        try:
            return bool(
                (impl is f[2] or impl == f[2])
                and scope is f[3]
                and dt is f[4]
                and (f[1] is None or grad() is f[1])
                and f[0](*guarded(args))
                and (not related or all(args[i].shape == args[j].shape for i, j in related))
                and (all(map(is_, o := options(args), rec := f[6:])) or same_options(o, rec))
            )
        except Exception:  # an option that compares oddly (a tensor eps), a non-tensor
            return False

    def dispatch(impl: Any, *args: Any) -> Any:
        if dyn():  # the rest of a compile reaches the slow path (see hot_path._TRACING_EXPR)
            return custom_op(impl, *args)
        if forward_ad_open():
            return op.forward_ad(impl, complete(args))
        if len(args) != arity:
            args = complete(args)
        scope = scope_get()
        dt = det()
        f = fast[0] if fast else None
        if f is None or not hit(f, impl, args, scope, dt):
            for f in fast[1:]:
                if hit(f, impl, args, scope, dt):
                    break
            else:
                return slow(impl, args, scope, dt, grad())
            try:
                if f is not fast[0]:  # a class that alternates with others: tried first from now on
                    fast.remove(f)
                    fast.insert(0, f)
            except (ValueError, IndexError):  # another thread changed the list meanwhile
                pass
        d = f[5]
        if d.guarded:
            if d.cuda and capturing():
                d = op._captured(d.key, args)
            if d.raw and not plain(args):
                d = op._subclass(d.key, args, d)
        try:
            return d.fn(*args)
        except Exception as exc:
            return d.on_fault(exc, args)

    dispatch.__doc__ = type(op).dispatch.__doc__
    return dispatch


def _noop(*args: object) -> object:
    return args[0]


def _cases() -> list[tuple[str, str, Callable[[], object]]]:
    x, w = torch.randn(1, 64), torch.randn(64)
    g, u = torch.randn(1, 64), torch.randn(1, 64)
    logits, target = torch.randn(4, 32), torch.randint(0, 32, (4,))
    return [
        ("rms_norm", "norm.rms_norm", lambda: polykernel.rms_norm(x, w)),
        ("swiglu", "activation.swiglu", lambda: polykernel.swiglu(g, u)),
        ("cross_entropy", "loss.cross_entropy", lambda: polykernel.cross_entropy(logits, target)),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--json", help="also write the rows to this file (each as it is measured)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cases = _cases()
    announce(len(cases), per_case_s=args.rounds * args.calls * 3 * 1.5e-6 + 1, what="ops", path=args.json)
    out = RowFile(args.json, {"torch": torch.__version__, "guard": hit_guard.available()})
    for name, op_id, call in cases:
        op = registry.get_op(op_id)
        module = sys.modules[op.reference.__module__]
        generated, plain = _hot_dispatch(op), plain_dispatch(op)
        call()  # the decision, memoized; its guard recorded
        saved = {key: d.fn for key, d in op._memo.items()}
        bound = module._dispatch
        try:
            for d in op._memo.values():
                d.fn = _noop

            def via(fn: Callable[..., object]) -> Callable[[], object]:
                def run() -> object:
                    module._dispatch = fn
                    return call()

                return run

            # each candidate rebinds the module's dispatch before its batch (one store per call
            # in both, so the difference stays the dispatcher's)
            table = interleaved_best_us(
                {"no-op": lambda: _noop(None), "generated": via(generated), "plain": via(plain)}, args.rounds, args.calls
            )
        finally:
            module._dispatch = bound
            for key, fn in saved.items():
                if key in op._memo:
                    op._memo[key].fn = fn
        row = {
            "op": name,
            "generated_us": table["generated"] - table["no-op"],
            "plain_us": table["plain"] - table["no-op"],
            "raw": table,
        }
        row["plain_minus_generated_us"] = row["plain_us"] - row["generated_us"]
        out.add(
            row,
            f"{name:<14} generated {row['generated_us']:.3f} us, plain {row['plain_us']:.3f} us ({row['plain_minus_generated_us']:+.3f})",
        )
    out.finish(complete=True)


if __name__ == "__main__":
    main()
