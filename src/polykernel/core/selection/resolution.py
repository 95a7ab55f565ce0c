"""The resolution order (steps 1-6 of :mod:`polykernel.core.selection`), the memoized
:class:`Decision` it makes, and the runtime-fault policy (step 7) that resolves again."""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ...errors import ImplNotAvailableError, ImplVerificationError, UnknownImplError
from .. import first_call, registry
from .names import _parse_names, _parse_op_names
from .state import _broken, _check_env, _global, _lock, first_time, generation, log, log_once, routed, strict_mode
from .subclasses import subclass_name
from .verdicts import Verdict, _load, _verdicts

if TYPE_CHECKING:
    from ..protocols import OpLike


@dataclass
class Decision:
    """A memoized choice: the callable to run, where the choice came from, and its fallbacks."""

    op: OpLike
    key: tuple[Any, ...]
    impl: str
    fn: Any
    source: str  # argument, scope, env, global, tuned, auto, fallback
    may_fall_back: bool
    verdicts: list[Verdict] = field(default_factory=list)
    # The impl reads raw memory (``KernelSpec.accepts_subclasses`` is False): the hot path then
    # checks that no argument is a tensor subclass before calling it (see Op.call).
    raw: bool = True
    # The argument class is on a CUDA device: the hot path then asks whether a CUDA graph is being
    # captured (a capture is decided under its own key, graph-safe impls only).
    cuda: bool = False
    guarded: bool = True  # raw or cuda: one read on the hot path when neither applies
    # The guard that recognises this decision's calls without their argument class (Op.dispatch,
    # polykernel.core.hit_guard): built on the first call that takes it, kept for when it comes back.
    check: Any = None
    # Made on a DTensor call's miss (its route may take over: then it never runs), and whether an
    # impl call went through its first-call check since (see record_route).
    for_dtensor: bool = False
    ran: bool = False
    # A tuned decision's per-size-bucket chooser (polykernel.tuning.by_size.BySize), which ``fn``
    # runs; None otherwise. ``impl`` is then the first bucket's choice.
    by_size: Any = None
    # The settings' generation it was resolved in (state.generation): an older one is stale.
    generation: int = 0

    def fn_for(self, args: tuple[Any, ...]) -> Any:
        """What a call with ``args`` runs: ``fn``, or for a tuned decision its bucket's impl
        (whose attributes, e.g. a forward/backward split, the compiled path reads)."""
        return self.fn if self.by_size is None else self.by_size.slot(args).run.fn

    def impl_for(self, args: tuple[Any, ...]) -> str:
        """The impl that a call with ``args`` runs under this decision (its bucket's, if tuned)."""
        slot = None if self.by_size is None else self.by_size.slot_for(args)
        return self.impl if slot is None else slot.impl

    def on_fault(self, exc: Exception, args: tuple[Any, ...]) -> Any:
        """Runtime-fault policy: fall back from an impl chosen by steps 4-6 that raised."""
        import torch

        if not self.may_fall_back or strict_mode() or isinstance(exc, torch.OutOfMemoryError) or _passing_through(exc):
            raise exc
        if subclass_name(args) is not None:  # the next impl may read raw memory: never on a subclass
            raise exc
        if self.by_size is not None and self.by_size.slot_for(args) is None:
            raise exc  # the bucket's lookup raised (a bad POLYKERNEL_TUNE, say), before any impl ran
        argkey = self.key.argclass
        failed = self.impl_for(args)  # a tuned decision: the impl of this call's size bucket
        what = "failed verification" if isinstance(exc, ImplVerificationError) else "failed at run time"
        where = "" if self.by_size is None else f" on {self.by_size.label(args)}"
        message = (
            f"polykernel: {self.op.id}: impl {failed!r} {what}{where} "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
            f"falling back to the next impl for this argument class"
        )
        with _lock:
            _broken.setdefault((self.op.id, argkey), {})[failed] = f"{what}: {type(exc).__name__}"
            self.op.forget(self.key)
        try:
            # A tuned class stays chosen per bucket: the others keep their measured impls.
            nxt = decide(self.op, self.key, by_size=self.by_size is not None)
        except ImplNotAvailableError:
            # Nothing else can run: the user's own error is the useful one, and the impl must not
            # stay marked broken (it may be a transient failure or bad data, not a bad kernel).
            with _lock:
                _broken.get((self.op.id, argkey), {}).pop(failed, None)
            raise exc from None
        nxt.source = "fallback"
        try:
            out = nxt.fn(*args) if not nxt.may_fall_back else _call_guarded(nxt, args)
        except Exception as again:
            # The next impl fails on the same arguments too: the arguments (a tensor where a float
            # belongs, an inference tensor that autograd must save, a value no kernel takes) are
            # the cause, not this impl. A bad argument never marks an impl broken: undo, and
            # raise the first error with a note.
            with _lock:
                _broken.get((self.op.id, argkey), {}).pop(failed, None)
                self.op.forget(self.key)
            _add_note(
                exc,
                f"polykernel: {self.op.id}: the next impl ({nxt.impl_for(args)!r}) failed on the same arguments too "
                f"({type(again).__name__}), so nothing was marked broken: check the arguments",
            )
            raise exc from None
        if first_time(("fault", self.op.id, failed, argkey)):
            warnings.warn(message, RuntimeWarning, stacklevel=3)
            log.warning(message)
        return out


# Decisions made since the last clear_caches(), by (op id, memo key), in the order first made.
# Separate from the ops' memos, which are dropped whenever an op's impls or settings change.
# Mutated in place only (settings, explain and tests hold it), never rebound.
_record: dict[tuple[str, tuple[Any, ...]], Decision] = {}


def _passing_through(exc: Exception) -> bool:
    """``exc`` is torch.utils.checkpoint's, raised through the impl by a saved-tensor hook, not
    the impl's fault: the recomputation of a non-reentrant checkpoint stops early by raising from
    the hook that packs the region's last saved tensor, which may be saved inside an impl (a
    region that ends with a polykernel op); its CheckpointError reports a forward and a
    recomputation that differ. Falling back would mark the impl broken and run the next impl,
    whose saves overrun the recomputation (a CheckpointError: one more tensor saved than in the
    forward). The checkpoint module is loaded wherever a checkpoint runs (torch imports it)."""
    import sys

    checkpoint = sys.modules.get("torch.utils.checkpoint")
    if checkpoint is None:
        return False
    kinds = tuple(k for k in (getattr(checkpoint, "CheckpointError", None), getattr(checkpoint, "_StopRecomputationError", None)) if k)
    return isinstance(exc, kinds)


def _add_note(exc: BaseException, note: str) -> None:
    if hasattr(exc, "add_note"):  # Python >= 3.11
        exc.add_note(note)


def _call_guarded(decision: Decision, args: tuple[Any, ...]) -> Any:
    try:
        return decision.fn(*args)
    except Exception as exc:  # the next fallback's fault goes through the same policy
        return decision.on_fault(exc, args)


def decide(
    op: OpLike, key: tuple[Any, ...], args: tuple[Any, ...] | None = None, by_size: bool = False, for_dtensor: bool = False
) -> Decision:
    """Resolve ``key`` = (argkey, impl, scope, deterministic, capturing) and memoize it.

    ``args``: the call's real arguments (the op's miss path), which tuning may measure on.
    ``by_size``: choose per size bucket even if this key's answer is static (a tuned decision's
    fallback after a fault, whose other buckets keep their measured impls). ``for_dtensor``: made on
    a DTensor call's miss, whose route may run instead (see :func:`record_route`)."""
    gen = generation(op.id)
    decision = _resolve(op, key, args, measure=args is not None)
    if decision.source == "tuned" or (decision.source == "auto" and (by_size or _stored_class(op, key))):
        _choose_by_size(decision, args)
    decision.raw = any(not registry.specs_for(op)[n].accepts_subclasses for n in _impls_of(decision)) or op.id in routed
    decision.fn = first_call.checked(decision)  # outputs and backward checked on the first call
    decision.cuda = getattr(key.argclass[0], "type", None) == "cuda"
    decision.guarded = decision.raw or decision.cuda
    decision.for_dtensor = for_dtensor
    decision.generation = gen
    op.remember(key, decision)
    if generation(op.id) != gen:  # set_impl, register_impl... in another thread while resolving: this
        op.forget(key)  # call runs it, the memo must not keep it (checked after remember: no gap)
    _record[(op.id, key)] = decision  # what `decisions()` lists; outlives the memo
    return decision


def _stored_class(op: OpLike, key: tuple[Any, ...]) -> bool:
    """Whether the tuning store holds another size bucket of this class (this call's has none)."""
    from ... import tuning

    return tuning.stores_class(op, key.argclass, bool(key.deterministic))  # type: ignore[attr-defined]


def _impls_of(decision: Decision) -> list[str]:
    """The impls a decision may run: its own, and for a per-bucket one every runnable impl."""
    if decision.by_size is None:
        return [decision.impl]
    return [v.name for v in decision.verdicts if v.runnable]


def _choose_by_size(decision: Decision, args: tuple[Any, ...] | None) -> None:
    """Make a tuned decision choose per size bucket (:class:`polykernel.tuning.by_size.BySize`):
    its ``fn`` becomes the chooser, seeded with its own choice for ``args``' bucket."""
    import dataclasses

    from ...tuning.by_size import BySize

    op, argkey = decision.op, decision.key.argclass
    rows = decision.verdicts
    by_name = {v.name: v for v in rows}
    static = _auto(op, rows, decision.key) if decision.source == "tuned" else decision
    if static is None:  # (the torch impl is eligible everywhere: not expected)
        return

    def load(name: str) -> Any:
        v = by_name.get(name)
        return _load(op, v) if v is not None and v.runnable else None

    def checked(name: str, fn: Any) -> Any:
        # Another impl than the decision's own: its first call checked as a decision for it would be.
        shadow = dataclasses.replace(decision, impl=name, fn=fn, by_size=None, check=None)
        shadow.fn = first_call.checked(shadow)
        return shadow

    chooser = BySize(
        op, argkey, rows, bool(decision.key.capturing), bool(decision.key.deterministic), load, (static.impl, static.fn), checked
    )
    if args is not None and decision.source == "tuned":
        chooser.seed(args, decision.impl, decision.fn)
    decision.by_size = chooser
    decision.fn = chooser if args is None else chooser.function(args)


def record_route(op: OpLike, key: tuple[Any, ...], subclass: str, impl: str, source: str) -> None:
    """Record, for ``decisions()``, a call that a layer above ran itself rather than through a
    decision (a vocab-parallel loss: torch math on the local slices, ``source`` says which route)."""
    plain = _record.get((op.id, key))
    if plain is not None and plain.for_dtensor and not plain.ran:  # made for this call, superseded by the route
        del _record[(op.id, key)]
    routed_key = key._replace(subclass=subclass)  # type: ignore[attr-defined]
    if (op.id, routed_key) not in _record:
        _record[(op.id, routed_key)] = Decision(op, routed_key, impl, None, source, False, [], raw=False, ran=True)


def _resolve(op: OpLike, key: tuple[Any, ...], args: tuple[Any, ...] | None = None, measure: bool = False) -> Decision:
    _check_env()
    argkey, impl, scope, det, capturing, subclass = key  # subclass: a tensor-subclass argument's type (see Op.call)
    rows = _verdicts(op, argkey, det, capturing, subclass)
    by_name = {v.name: v for v in rows}
    strict_env = strict_mode()

    def runnable_names() -> list[str]:
        return [v.name for v in rows if v.runnable]

    def strict(name: str, source: str) -> Decision:
        v = by_name.get(name)
        if v is None:
            raise UnknownImplError(op.id, name, sorted(by_name), "", runnable_names())
        fn = _load(op, v) if v.runnable else None
        if fn is None:
            raise ImplNotAvailableError(op.id, name, v.reason or "not runnable", runnable_names())
        return Decision(op, key, name, fn, source, False, rows)

    def prefer(names: Sequence[str], source: str, may_fall_back: bool) -> Decision | None:
        for name in names:
            v = by_name.get(name)
            if v is not None and v.runnable:
                fn = _load(op, v)
                if fn is not None:
                    return Decision(op, key, name, fn, source, may_fall_back, rows)
        why = ", ".join(f"{n}: {by_name[n].reason}" if n in by_name else f"{n}: not registered for this op" for n in names)
        if strict_env:
            raise ImplNotAvailableError(op.id, ",".join(names), f"preference ({source}) cannot be met: {why}", runnable_names())
        # once per reason, not per argument class: a peer that is not installed is one line per op
        log_once(("skip", op.id, source, tuple(names), why), f"polykernel: {op.id}: {source} preference {','.join(names)} skipped ({why})")
        return None

    # 1. impl= argument
    if impl is not None:
        names = _parse_op_names(impl, f"{op.name}(impl=)", op.id, runnable_names())
        if len(names) == 1:
            return strict(names[0], "argument")
        hit = prefer(names, "argument", False)
        if hit is None:
            raise ImplNotAvailableError(op.id, ",".join(names), "none of these impls can run here", runnable_names())
        return hit
    # 2. scopes, innermost first
    for scope_op, names in reversed(scope):
        if scope_op == op.id:
            return strict(names[0], "scope") if len(names) == 1 else _required(prefer(names, "scope", False), op, names, runnable_names())
        if scope_op is None:
            hit = prefer(names, "scope", False)
            if hit is not None:
                return hit
    # 3. environment
    per_op = os.environ.get(f"POLYKERNEL_IMPL_{op.name.upper()}")
    if per_op:
        names = _parse_op_names(per_op, f"POLYKERNEL_IMPL_{op.name.upper()}", op.id, runnable_names())
        return strict(names[0], "env") if len(names) == 1 else _required(prefer(names, "env", False), op, names, runnable_names())
    everywhere = os.environ.get("POLYKERNEL_IMPL")
    if everywhere:
        hit = prefer(_parse_names(everywhere, "POLYKERNEL_IMPL"), "env", False)
        if hit is not None:
            return hit
    # 4. set_impl
    broken = _broken.get((op.id, argkey), {})
    if op.id in _global and not all(n in broken for n in _global[op.id]):  # broken: step 7 moves on
        names = _global[op.id]
        if len(names) == 1:
            chosen = strict(names[0], "global")
            chosen.may_fall_back = True
            return chosen
        return _required(prefer(names, "global", True), op, names, runnable_names())
    if None in _global:
        hit = prefer(_global[None], "global", True)
        if hit is not None:
            return hit
    # 5. tuned
    tuned = _tuned(op, argkey, args, rows, capturing, measure, det)
    if tuned is not None:
        v = by_name.get(tuned)
        if v is not None and v.runnable:
            fn = _load(op, v)
            if fn is not None:
                return Decision(op, key, tuned, fn, "tuned", True, rows)
    # 6. auto (the torch impl is eligible everywhere, so this finds one). It never goes past the
    # torch impl, the fallback of last resort: an impl ranked behind it (torch_compile, whose first
    # call compiles) runs by name or by measurement, so a failing torch impl's error surfaces
    # instead of a compile that hides it.
    auto = _auto(op, rows, key)
    if auto is not None:
        return auto
    raise ImplNotAvailableError(op.id, "auto", "no registered impl can run for these arguments", [])


def _auto(op: OpLike, rows: list[Verdict], key: Any = None) -> Decision | None:
    """Step 6: the best-ranked runnable impl, never one ranked behind the torch impl."""
    last = next((v for v in rows if v.name == "torch"), None)
    for v in rows:
        if last is not None and v.rank > last.rank:
            break
        if v.runnable:
            fn = _load(op, v)
            if fn is not None:
                return Decision(op, key, v.name, fn, "auto", True, rows)
    return None


def _required(hit: Decision | None, op: OpLike, names: Sequence[str], runnable: list[str]) -> Decision:
    if hit is None:
        raise ImplNotAvailableError(op.id, ",".join(names), "none of these impls can run here", runnable)
    return hit


def _tuned(
    op: OpLike, argkey: tuple[Any, ...], args: tuple[Any, ...] | None, rows: list[Verdict], capturing: bool, measure: bool, det: bool
) -> str | None:
    """Step 5 hook: the measured-selection module answers (and, on a miss in mode ``on``, measures)."""
    from ... import tuning

    return tuning.lookup(op, argkey, args, rows, capturing, measure, det)
