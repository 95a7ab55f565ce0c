"""Selection: the resolution order, its memo, ``explain`` records and the runtime-fault policy.

Resolution order for one call (first that applies wins):

1. ``impl=`` argument of the call (strict);
2. ``with use_impl(...)`` scope, innermost first (strict when it names an op, else a preference);
3. env ``POLYKERNEL_IMPL_<OP>`` (strict), then env ``POLYKERNEL_IMPL`` (a preference list);
4. ``set_impl(...)`` (strict when it names an op, else a preference);
5. a tuned (measured) decision, when tuning holds one for this key;
6. auto: the lowest rank among the runnable impls (a spec's ``rank_for`` may set the rank of
   one argument class, from measurements; ``explain`` shows why), never one ranked behind the
   torch impl (those run by name or by measurement);
7. at run time, an impl chosen by 4-6 that raises falls back to the next runnable one (up to the
   torch impl, as in 6).

Strict means: unknown for the op, or not runnable here, raises :class:`ImplNotAvailableError`.
A preference skips ops that lack the impl (logged once); ``POLYKERNEL_STRICT=1`` makes that skip,
and every runtime fallback, an error. Environment variables are read when a decision is made
for a new key; after changing them in-process, call :func:`clear_caches`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import warnings
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .. import env
from ..errors import ImplNotAvailableError, ImplVerificationError, OpTypeError, UnknownImplError, shown
from ..spec import KernelBackend, KernelSpec, PlatformInfo
from . import first_call, hooks, memo_key, registry
from .explain_args import call_args, device_arg, dtype_arg, rejection

if TYPE_CHECKING:
    from .op import Op

__all__ = [
    "Decision",
    "Explanation",
    "available_impls",
    "clear_caches",
    "explain",
    "get_impl_settings",
    "set_impl",
    "use_impl",
]

log = logging.getLogger("polykernel")

# Scope entries, innermost last: (op id or None, impl names). A tuple, so it can be a memo key.
_scope: ContextVar[tuple[tuple[str | None, tuple[str, ...]], ...]] = ContextVar("polykernel_scope", default=())
SCOPE = _scope  # the ContextVar itself: the hot path reads it (core.op)
_global: dict[str | None, tuple[str, ...]] = {}
_broken: dict[tuple[str, tuple[Any, ...]], dict[str, str]] = {}
_logged: set[tuple[Any, ...]] = set()
_lock = threading.RLock()


def _split_names(value: Any, where: str) -> tuple[str, ...]:
    """``"triton"``, ``"triton,torch"``, a ``KernelBackend`` or a sequence -> names (unchecked).
    Anything else, or no name at all (``""``, ``",,,"``), is a ``ValueError`` naming ``where``."""
    if isinstance(value, KernelBackend):
        return (value.value,)
    if isinstance(value, str):
        items = [v.strip() for v in value.split(",")]
    elif isinstance(value, (list, tuple)):
        items = [v.value if isinstance(v, KernelBackend) else v.strip() if isinstance(v, str) else v for v in value]
    else:
        raise ValueError(f"{where}: {shown(value)} is not an impl name (expected a name, 'a,b' or a list of names)")
    names = tuple(v for v in items if v != "")
    if not names:
        raise ValueError(f"{where}: {shown(value)} is not an impl name (empty)")
    for name in names:
        if not isinstance(name, str):
            raise ValueError(f"{where}: {shown(name)} is not an impl name (expected a string)")
    return names


def _parse_names(value: str | Sequence[str] | KernelBackend, where: str) -> tuple[str, ...]:
    """Names for a global preference (any op): each must be a ``KernelBackend`` value (one that
    no op has yet is accepted: it skips every op), else a ``ValueError`` that names ``where``
    (the variable or function) and the impl names the registered ops have."""
    names = _split_names(value, where)
    valid = {b.value for b in KernelBackend}
    for name in names:
        if name not in valid:
            raise ValueError(f"{where}: {shown(name)} is not an impl name; {_impl_names_text(name)}")
    return names


def _impl_names_text(name: str) -> str:
    """The impl names some registered op has (the catalog loaded), a close match, and the
    ``KernelBackend`` values reserved for impls no op has yet. Off the hot path: errors only."""
    import difflib

    registry.load_catalog()
    used = sorted({impl for op_id in registry.all_op_ids() for impl in registry.specs_for(op_id)})
    reserved = sorted(b.value for b in KernelBackend if b.value not in used)
    close = difflib.get_close_matches(name, used + reserved, n=1) if len(name) <= 64 else []  # a typo, not a pasted blob
    text = f"the ops' impls are: {', '.join(used)}"
    if close:
        text += f" (did you mean {close[0]!r}?)"
    if reserved:
        text += f"; KernelBackend also reserves {', '.join(reserved)}, which no op has yet"
    return text


def _parse_op_names(value: Any, where: str, op_id: str, runnable: Sequence[str] | None = None) -> tuple[str, ...]:
    """Names asked of one op (``impl=``, ``op=``, ``POLYKERNEL_IMPL_<OP>``): a name that is not
    a ``KernelBackend`` value, or a single name the op lacks, is an :class:`UnknownImplError`
    listing the op's impls. (A list may name impls the op lacks: it is a preference.)"""
    valid = sorted(registry.specs_for(op_id))
    try:
        names = _split_names(value, where)
    except ValueError:
        raise UnknownImplError(op_id, value, valid, where, runnable) from None
    backends = {b.value for b in KernelBackend}
    for name in names:
        if name not in backends or (len(names) == 1 and name not in valid):
            raise UnknownImplError(op_id, name, valid, where, runnable)
    return names


def strict_mode() -> bool:
    # Read on slow paths only (a new decision, a runtime fault): a bad value raises there.
    return env.flag("POLYKERNEL_STRICT", False)


_env_checked = False  # env.check ran since the last clear_caches (it warns of misspelt names)


def _check_env() -> None:
    global _env_checked
    if not _env_checked:
        with _lock:  # threads meeting their first decisions at once warn once
            if not _env_checked:
                env.check([op_id.rpartition(".")[2] for op_id in registry.all_op_ids()], strict_mode())
                _env_checked = True  # not before: under strict mode every decision raises until fixed


# ------------------------------------------------------------------------------------------
# Public controls


@contextlib.contextmanager
def use_impl(impl: str | Sequence[str], op: str | None = None) -> Iterator[None]:
    """Scoped override for this thread/task (a ContextVar).

    With ``op`` the choice is strict for that op; without, it is a preference list applied to
    every op that has the impl (ops without it keep their normal choice)::

        with polykernel.use_impl("torch"):
            y = polykernel.rms_norm(x, w)        # torch impl
        with polykernel.use_impl("triton", op="rms_norm"):
            y = polykernel.rms_norm(x, w)        # triton or ImplNotAvailableError
    """
    op_id = registry.resolve_op_id(op) if op is not None else None
    names = _parse_names(impl, "use_impl") if op_id is None else _parse_op_names(impl, "use_impl", op_id)
    token = _scope.set((*_scope.get(), (op_id, names)))
    try:
        yield
    finally:
        _scope.reset(token)


def set_impl(impl: str | Sequence[str] | None, op: str | None = None) -> None:
    """Process-wide choice (step 4 of the order). ``set_impl(None)`` resets it.

    ``set_impl("triton")`` prefers Triton wherever an op has it; ``set_impl("torch", op="softmax")``
    forces one op (strict). ``set_impl(None, op="softmax")`` resets that op only.
    """
    op_id = registry.resolve_op_id(op) if op is not None else None
    with _lock:
        if impl is None:
            if op_id is None:
                _global.clear()
            else:
                _global.pop(op_id, None)
        else:
            names = _parse_names(impl, "set_impl") if op_id is None else _parse_op_names(impl, "set_impl", op_id)
            _global[op_id] = names
    clear_memos()


def restore_impl_settings(settings: dict[str | None, tuple[str, ...]]) -> None:
    """Put back what :func:`get_impl_settings` returned (and clear the memo)."""
    with _lock:
        _global.clear()
        _global.update(settings)
    clear_caches()


def get_impl_settings() -> dict[str | None, tuple[str, ...]]:
    """The current ``set_impl`` settings (op id or None -> names)."""
    return dict(_global)


def clear_caches() -> None:
    """Forget memoized decisions, runtime-fault marks and once-only log records."""
    global _env_checked
    _env_checked = False
    env.reset_warnings()
    with _lock:
        _broken.clear()
        _logged.clear()
        _record.clear()
    clear_memos()
    try:
        from .. import tuning

        tuning.clear_cache()
    except ImportError:
        pass


def clear_memos(op_id: str | None = None) -> None:
    """Drop memoized decisions: of ``op_id`` only (its impls changed), or of every op (None).
    The record that :func:`decisions` reads is kept: it lists what ran since ``clear_caches``."""
    if op_id is not None:
        op = registry.loaded_op(op_id)
        if op is not None:
            op.clear()
        return
    for op in registry.loaded_ops():
        op.clear()


registry.listen(clear_memos)


# ------------------------------------------------------------------------------------------
# Decisions


@dataclass
class Verdict:
    """One impl's standing for a key: runnable or not, and why."""

    name: str
    rank: int
    reason: str | None  # None: runnable
    rank_note: str | None = None  # why ``rank`` is not the spec's static rank (KernelSpec.rank_for)

    @property
    def runnable(self) -> bool:
        return self.reason is None


@dataclass
class Decision:
    """A memoized choice: the callable to run, where the choice came from, and its fallbacks."""

    op: Op
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

        if not self.may_fall_back or strict_mode() or isinstance(exc, torch.OutOfMemoryError):
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
        once = ("fault", self.op.id, failed, argkey)
        if once not in _logged:
            _logged.add(once)
            warnings.warn(message, RuntimeWarning, stacklevel=3)
            log.warning(message)
        return out


def _add_note(exc: BaseException, note: str) -> None:
    if hasattr(exc, "add_note"):  # Python >= 3.11
        exc.add_note(note)


def _call_guarded(decision: Decision, args: tuple[Any, ...]) -> Any:
    try:
        return decision.fn(*args)
    except Exception as exc:  # the next fallback's fault goes through the same policy
        return decision.on_fault(exc, args)


def _verdicts(op: Op, argkey: tuple[Any, ...], deterministic: bool, capturing: bool, subclass: str | None = None) -> list[Verdict]:
    """Every impl of ``op`` with why it can or cannot take this argument class, in rank order.
    ``subclass``: the type name of a tensor-subclass argument (None: plain tensors only)."""
    specs = registry.specs_for(op)
    info = op.arg_class(argkey)
    platform = PlatformInfo.detect(info.device)
    broken = _broken.get((op.id, argkey), {})
    rows = []
    for name, spec in specs.items():
        rank, note = spec.rank_here(info)  # on a memo miss only: the hot path never gets here
        rows.append(Verdict(name, rank, _why_not(spec, info, platform, deterministic, capturing, broken, subclass), note))
    rows.sort(key=lambda v: (v.rank, v.name))
    return rows


def _why_not(
    spec: KernelSpec, info: Any, platform: PlatformInfo, det: bool, capturing: bool, broken: dict, subclass: str | None = None
) -> str | None:
    if spec.impl in broken:
        return broken[spec.impl]
    reason = spec.unavailable_reason(platform)
    if reason:
        return reason
    if subclass == INFERENCE and spec.impl != "torch":
        return "an inference tensor that autograd must save: only the torch impl's autograd can"
    if subclass is not None and subclass != INFERENCE and not spec.accepts_subclasses:
        return f"input is a tensor subclass ({subclass}); this impl reads raw memory"
    if not spec.format_signature.supports_dtype(info.dtype):
        return f"dtype {str(info.dtype).removeprefix('torch.')} not supported"
    if info.needs_grad and not spec.format_signature.supports_backward:
        return "has no backward (inputs require grad)"
    if det and not spec.deterministic:
        return "not deterministic (torch.use_deterministic_algorithms is on)"
    if capturing and not spec.cuda_graph_safe:
        return "not CUDA-graph safe (a graph is being captured)"
    if spec.predicate is not None:
        try:
            reason = spec.predicate(info)
        except Exception as exc:  # a broken predicate excludes its impl, visibly
            reason = f"predicate raised {type(exc).__name__}: {exc}"
        if reason:
            return reason
    return None


def _load(op: Op, verdict: Verdict) -> Any:
    """Import the impl (lazily, on first selection); an import failure makes it not runnable."""
    spec = registry.specs_for(op)[verdict.name]
    try:
        return registry.load_impl(spec)
    except Exception as exc:  # any import failure: not runnable, with the reason in explain
        # A required module that fails to import (any exception) is named, and then known to
        # every op's verdicts (KernelSpec.unavailable_reason); else the adapter's own failure.
        verdict.reason = spec.import_error() or f"import failed: {type(exc).__name__}: {exc}"
        return None


def _probe_imports(op: Op, rows: list[Verdict]) -> list[Verdict]:
    """explain and available_impls: an impl runnable by its metadata whose required module fails
    to import is not runnable (imports the installed modules of those impls; a peer whose
    front package raises at import, e.g. RuntimeError, must not be listed as runnable)."""
    specs = registry.specs_for(op)
    for v in rows:
        spec = specs.get(v.name)
        if v.runnable and spec is not None and spec.requires_modules:
            v.reason = spec.import_error()
    return rows


def log_once(key: tuple[Any, ...], message: str) -> None:
    if key not in _logged:
        _logged.add(key)
        log.warning(message)


def decide(op: Op, key: tuple[Any, ...], args: tuple[Any, ...] | None = None, by_size: bool = False, for_dtensor: bool = False) -> Decision:
    """Resolve ``key`` = (argkey, impl, scope, deterministic, capturing) and memoize it.

    ``args``: the call's real arguments (the op's miss path), which tuning may measure on.
    ``by_size``: choose per size bucket even if this key's answer is static (a tuned decision's
    fallback after a fault, whose other buckets keep their measured impls). ``for_dtensor``: made on
    a DTensor call's miss, whose route may run instead (see :func:`record_route`)."""
    decision = _resolve(op, key, args, measure=args is not None)
    if decision.source == "tuned" or (decision.source == "auto" and (by_size or _stored_class(op, key))):
        _choose_by_size(decision, args)
    decision.raw = any(not registry.specs_for(op)[n].accepts_subclasses for n in _impls_of(decision)) or op.id in routed
    decision.fn = first_call.checked(decision)  # outputs and backward checked on the first call
    decision.cuda = getattr(key.argclass[0], "type", None) == "cuda"
    decision.guarded = decision.raw or decision.cuda
    decision.for_dtensor = for_dtensor
    op.remember(key, decision)
    _record[(op.id, key)] = decision  # what `decisions()` lists; outlives the memo
    return decision


def _stored_class(op: Op, key: tuple[Any, ...]) -> bool:
    """Whether the tuning store holds another size bucket of this class (this call's has none)."""
    from .. import tuning

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

    from ..tuning.by_size import BySize

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


def record_route(op: Op, key: tuple[Any, ...], subclass: str, impl: str, source: str) -> None:
    """Record, for ``decisions()``, a call that a layer above ran itself rather than through a
    decision (a vocab-parallel loss: torch math on the local slices, ``source`` says which route)."""
    plain = _record.get((op.id, key))
    if plain is not None and plain.for_dtensor and not plain.ran:  # made for this call, superseded by the route
        del _record[(op.id, key)]
    routed_key = key._replace(subclass=subclass)  # type: ignore[attr-defined]
    if (op.id, routed_key) not in _record:
        _record[(op.id, routed_key)] = Decision(op, routed_key, impl, None, source, False, [], raw=False, ran=True)


# Ops whose tensor-subclass arguments a layer above routes itself (polykernel.distributed.dtensor adds its ops
# when a DTensor is first seen, then clears the memos): their decisions all take the subclass
# check, so a DTensor never reaches even a torch impl directly. Empty, and free, until then.
routed: set[str] = set()

# Decisions made since the last clear_caches(), by (op id, memo key), in the order first made.
# Separate from the ops' memos, which are dropped whenever an op's impls or settings change.
_record: dict[tuple[str, tuple[Any, ...]], Decision] = {}


# The pseudo subclass of a call whose autograd must save an inference tensor (made under
# torch.inference_mode, with another argument needing a gradient): torch's own ops can, an
# autograd.Function's save_for_backward cannot. Such calls are decided under their own key, where
# only the torch impl is eligible, so that a kernel's refusal never marks it broken for the class.
INFERENCE = "inference tensor"


def saves_inference_tensor(tensors: Sequence[Any]) -> bool:
    """Whether autograd must save one of ``tensors`` that is an inference tensor (grad mode on,
    one of them requires grad, one is an inference tensor). Off the hot path."""
    import torch

    present = [t for t in tensors if isinstance(t, torch.Tensor)]
    return torch.is_grad_enabled() and any(t.requires_grad for t in present) and any(t.is_inference() for t in present)


def subclass_name(args: Sequence[Any]) -> str | None:
    """The type name of the first tensor argument that is a tensor subclass, else None.

    ``torch.Tensor`` and ``torch.nn.Parameter`` are plain; anything else that is a tensor (a
    DTensor, a ``__torch_dispatch__`` wrapper, a ``__torch_function__`` subclass, and FakeTensor
    or FunctionalTensor when a tracer hands them to the eager path) is a subclass. Tensors in
    lists and tuples count too. Off the hot path: :meth:`Op.call` checks types cheaply first.
    """
    import torch

    for a in args:
        if isinstance(a, torch.Tensor):
            if type(a) is not torch.Tensor and type(a) is not torch.nn.Parameter:
                return type(a).__name__
        elif isinstance(a, (list, tuple)):
            inner = subclass_name(a)
            if inner is not None:
                return inner
    return None


def _resolve(op: Op, key: tuple[Any, ...], args: tuple[Any, ...] | None = None, measure: bool = False) -> Decision:
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
        log_once(
            ("skip", op.id, source, tuple(names), argkey), f"polykernel: {op.id}: {source} preference {','.join(names)} skipped ({why})"
        )
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


def _auto(op: Op, rows: list[Verdict], key: Any = None) -> Decision | None:
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


def _required(hit: Decision | None, op: Op, names: Sequence[str], runnable: list[str]) -> Decision:
    if hit is None:
        raise ImplNotAvailableError(op.id, ",".join(names), "none of these impls can run here", runnable)
    return hit


def _tuned(
    op: Op, argkey: tuple[Any, ...], args: tuple[Any, ...] | None, rows: list[Verdict], capturing: bool, measure: bool, det: bool
) -> str | None:
    """Step 5 hook: the measured-selection module answers (and, on a miss in mode ``on``, measures)."""
    from .. import tuning

    return tuning.lookup(op, argkey, args, rows, capturing, measure, det)


# ------------------------------------------------------------------------------------------
# Introspection


@dataclass
class Explanation:
    """Why an impl was (or would be) chosen for one call. ``str()`` gives a readable table."""

    op: str
    platform: str
    arg_class: dict[str, Any]
    chosen: str | None
    source: str | None
    error: str | None
    impls: list[dict[str, Any]]
    import_errors: dict[str, str]
    tuned: dict[str, Any] | None = None  # source "tuned": the store key, the choice and the measured times
    route: str | None = None  # DTensor arguments: the path taken (local shards or DTensor's rules) and why

    def __str__(self) -> str:
        args = ", ".join(f"{k}={_short(v)}" for k, v in self.arg_class.items())
        lines = [f"{self.op} on {self.platform}", f"  arguments: {args}"]
        if self.route:
            lines.append(f"  route: {self.route}")
        if self.chosen:
            lines.append(f"  chosen: {self.chosen} (source: {self.source})")
        else:
            lines.append(f"  chosen: none ({self.error})")
        width = max([len(r["name"]) for r in self.impls] + [4])
        for r in self.impls:
            mark = "*" if r["name"] == self.chosen else " "
            verdict = "runnable" if r["runnable"] else f"no: {r['reason']}"
            lines.append(f"  {mark} {r['name']:<{width}}  rank {r['rank']:>3}  {verdict}")
            if r.get("rank_reason"):
                lines.append(f"    {'':<{width}}  rank {r['rank']} for these arguments: {r['rank_reason']}")
        for module, err in self.import_errors.items():
            lines.append(f"  ! module {module} failed to import: {err}")
        if self.tuned:
            lines.append(_tuned_lines(self.tuned))
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "platform": self.platform,
            "arg_class": {k: _short(v) for k, v in self.arg_class.items()},
            "chosen": self.chosen,
            "source": self.source,
            "error": self.error,
            "impls": self.impls,
            "import_errors": self.import_errors,
            "tuned": self.tuned,
            "route": self.route,
        }


def _tuned_times(op: Op, argkey: tuple[Any, ...]) -> dict[str, Any] | None:
    from .. import tuning

    return tuning.measured(op, argkey)


def _tuned_lines(tuned: dict[str, Any]) -> str:
    """``measured (ms): triton gpu 0.051 host 0.012; torch gpu 0.090 host 0.008`` (or an error)."""
    cells = []
    for name, t in tuned.get("times", {}).items():
        if t.get("error"):
            cells.append(f"{name} {t['error']}")
        else:
            gpu = "" if t.get("gpu_ms") is None else f" gpu {t['gpu_ms']:.4g}"
            cells.append(f"{name}{gpu} {'host' if gpu else 'wall'} {t.get('host_ms', float('nan')):.4g}")
    return "  measured (ms): " + ("; ".join(cells) or tuned.get("note", "no times"))


def _short(v: Any) -> Any:
    s = str(v)
    return s.removeprefix("torch.") if s.startswith("torch.") else (v if isinstance(v, (int, float, bool, type(None))) else s)


def _argkey_for(
    op: Op, args: tuple[Any, ...], kwargs: dict[str, Any], device: Any, dtype: Any, needs_grad: bool = False
) -> tuple[Any, ...]:
    import torch

    if args:
        return op.key(*args, **kwargs)
    dtype = dtype_arg(op, dtype)
    if device is None:  # "here": the current CUDA device if there is one, else the CPU
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = device_arg(op, device)
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    key = op.default_key(dev, dtype if dtype is not None else torch.float32)
    return (*key[:2], True, *key[3:]) if needs_grad else key  # fields start device, dtype, needs_grad


# True while explain asks about a DTensor call's local shards: the stand-ins it passes are empty
# tensors of the shards' shapes (their values are not the call's), so validation does not run on
# them (nor on the DTensors themselves, where a data check could need a collective).
_shard_stand_ins: ContextVar[bool] = ContextVar("polykernel_shard_stand_ins", default=False)


def explain(
    op: str, *args: Any, device: Any = None, dtype: Any = None, impl: str | None = None, needs_grad: bool = False, **kwargs: Any
) -> Explanation:
    """What would run for this call, and why: every impl with its verdict and reason.

    Give the call's own arguments, or just ``device=``/``dtype=`` (a ``torch.dtype`` or its name:
    ``"bf16"``, ``"float16"``...) and ``needs_grad=True`` for a call whose inputs require grad
    (with arguments, their ``requires_grad`` decides and ``needs_grad`` must be left False). The op's validation runs as in the call: bad arguments raise
    its error (a missing one the call's ``TypeError``); a dtype the op rejects leaves no impl
    chosen, with the op's error in ``error``::

        >>> import polykernel, torch
        >>> print(polykernel.explain("rms_norm", torch.randn(4, 8), torch.ones(8)))  # doctest: +SKIP
        norm.rms_norm on cpu (cpu)
          chosen: torch (source: auto)
          ...
    """
    import torch

    the_op = registry.get_op(op)
    if needs_grad and args:
        raise ValueError(f"explain({op!r}): needs_grad is for a call described by device and dtype; the arguments' requires_grad decides")
    call = call_args(the_op, args, kwargs) if args else None  # a missing argument raises, as in the call
    subclass = subclass_name((*args, *kwargs.values()))
    if call is not None and subclass is None and not _shard_stand_ins.get():
        rejection(the_op, call, None)  # a bad argument raises, as in the call
    argkey = _argkey_for(the_op, args, kwargs, device, dtype, needs_grad)
    # (a CPU-only torch has no capture query: explain(device="cuda") still answers there)
    capturing = argkey[0].type == "cuda" and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    key = memo_key.key(argkey, impl, _scope.get(), torch.are_deterministic_algorithms_enabled(), capturing)
    route = None
    if subclass == "DTensor":  # tensor parallel: the local shards' explanation, or why not
        token = _shard_stand_ins.set(True)
        try:
            local, route = hooks.require("dtensor_explain")(
                the_op, key, args, kwargs, lambda *a, **k: explain(op, *a, device=device, dtype=dtype, impl=impl, **k)
            )
        finally:
            _shard_stand_ins.reset(token)
        if local is not None:
            return local
    if subclass is not None:
        key = key._replace(subclass=subclass)
    chosen = source = error = None
    rejected = None if args else rejection(the_op, None, argkey[1])
    if rejected is not None:  # the call would raise this before choosing: no impl runs
        error = str(rejected)
        why = f"dtype {_short(argkey[1])} not supported" if isinstance(rejected, OpTypeError) else f"arguments rejected: {error}"
        rows = [Verdict(v.name, v.rank, why, v.rank_note) for v in _verdicts(the_op, argkey, key.deterministic, capturing, subclass)]
    else:
        try:
            tensors = (*args, *kwargs.values()) if args else None  # tuning keys on the call's tensors
            d = _resolve(the_op, key, tensors)
            chosen, source, rows = d.impl, d.source, d.verdicts
        except ImplNotAvailableError as exc:
            error = str(exc)
            rows = _verdicts(the_op, argkey, key.deterministic, capturing, subclass)
    return Explanation(
        op=the_op.id,
        platform=str(PlatformInfo.detect(argkey[0])),
        arg_class=the_op.arg_class(argkey).as_dict(),
        chosen=chosen,
        source=source,
        error=error,
        impls=[
            {"name": v.name, "rank": v.rank, "runnable": v.runnable, "reason": v.reason, "rank_reason": v.rank_note}
            for v in _probe_imports(the_op, [Verdict(v.name, v.rank, v.reason, v.rank_note) for v in rows])
        ],
        import_errors=registry.import_errors(the_op),
        tuned=_tuned_times(the_op, argkey) if source == "tuned" else None,
        route=route(chosen) if route is not None else None,
    )


def available_impls(op: str, device: Any = None, dtype: Any = None) -> list[str]:
    """Names of the impls that can run for ``op`` on ``device``/``dtype``, in selection order.

    >>> import polykernel
    >>> polykernel.available_impls("rms_norm", device="cpu")[-1]
    'torch'
    """
    import torch

    the_op = registry.get_op(op)
    argkey = _argkey_for(the_op, (), {}, device, dtype)
    rows = _probe_imports(the_op, _verdicts(the_op, argkey, torch.are_deterministic_algorithms_enabled(), False))
    return [v.name for v in rows if v.runnable]


def decisions(op: str | None = None) -> list[dict[str, Any]]:
    """The decisions made since the last ``clear_caches()`` (what actually ran), one per key.

    Each record: op id, the argument class, the impl, the source of the choice (argument, scope,
    env, global, tuned, auto, fallback) and the better-ranked impls that did not run, with why::

        >>> import polykernel, torch
        >>> _ = polykernel.rms_norm(torch.randn(2, 8), torch.ones(8))
        >>> polykernel.decisions("rms_norm")[-1]["impl"] in ("torch", "triton")
        True
    """
    wanted = registry.get_op(op).id if op is not None else None
    records = [(op_id, key, d) for (op_id, key), d in list(_record.items()) if wanted is None or op_id == wanted]
    records.sort(key=lambda r: r[0])  # by op id; within an op, in the order the decisions were made
    out = []
    for op_id, key, d in records:
        skipped = []
        for v in d.verdicts:
            if v.name == d.impl:
                break
            skipped.append((v.name, v.reason or "runnable, lower preference"))
        record = {"op": op_id, "arg_class": d.op.arg_class(key.argclass).as_dict(), "impl": d.impl, "source": d.source, "skipped": skipped}
        if key.subclass is not None:
            record["subclass"] = key.subclass
        if d.by_size is not None:  # a tuned decision: what each size bucket met ran
            record["by_size"] = d.by_size.record()
        out.append(record)
    return out
