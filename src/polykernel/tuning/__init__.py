"""Measured selection (step 5 of the resolution order): modes, lookups, measuring, distributed sync.

``POLYKERNEL_TUNE`` (read when a decision is made for a new key):

- ``off``: static ranks only;
- ``cached`` (default): a stored decision for the key when there is one, else static ranks;
- ``on``: also measure on first sight of a new key (in the op's miss path, on clones of the
  call's real arguments) and store the result.

The dispatcher asks :func:`lookup` on a memo miss; the answer is only an impl *name*, which the
dispatcher honours only if it is a registered impl that is runnable for the call (nothing named
in a store is ever imported). Nothing is measured under CUDA-graph capture or ``torch.compile``
tracing, nor for tensor subclasses or fake/meta tensors: the stored or static choice is used.

The key and the environment identity are in :mod:`polykernel.tuning.key`, the JSON store in
:mod:`polykernel.tuning.json_store`, timing and the cost model in :mod:`polykernel.tuning.measure`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from ..core import registry, verify

if TYPE_CHECKING:
    from ..core.protocols import OpLike
    from .json_store import Store

__all__ = ["calls", "clear_cache", "lookup", "margin", "measured", "mode", "remember", "store", "sync_decisions"]

log = logging.getLogger("polykernel")

_MODES = ("off", "cached", "on")
DEFAULT_MARGIN = 0.03
# A per-process compile (torch_compile, seconds) is charged as if spread over this many calls of
# the key: 0.1 ms per call for a 10 s compile, so it wins only by more than that (POLYKERNEL_TUNE_CALLS).
DEFAULT_CALLS = 100_000
_lock = threading.RLock()
_store: Store | None = None
_pinned: dict[tuple[str, tuple[Any, ...]], str] = {}  # remember(): in-process, no measurement
_seen: dict[tuple[str, tuple[Any, ...]], tuple[str, dict[str, Any]]] = {}  # argument class -> (key, entry)
# Held while a thread measures: one measurement at a time in a process. Threads meeting one new
# key wait for its entry; threads meeting other keys wait too, since timings taken side by side
# (one clock, one GPU stream, the GIL) would each count the other's work. Never re-entered: a
# measurement's nested op calls do not measure (``_busy``).
_measuring = threading.Lock()
_busy = threading.local()  # set while measuring: a nested op call uses stored/static choices
# Set by `collecting()` (the `tune` command): measure every key met, return records, store nothing.
_collect: ContextVar[list[dict[str, Any]] | None] = ContextVar("polykernel_tune_collect", default=None)


def _shown(raw: str) -> str:
    return repr(raw if len(raw) <= 60 else raw[:57] + "...") + (f" ({len(raw)} characters)" if len(raw) > 60 else "")


def mode() -> str:
    """``POLYKERNEL_TUNE``: ``off``, ``cached`` (default, also when empty) or ``on``."""
    raw = os.environ.get("POLYKERNEL_TUNE")
    if raw is None or not raw.strip():
        return "cached"
    value = raw.strip().lower()
    if value not in _MODES:
        raise ValueError(f"POLYKERNEL_TUNE={_shown(raw)}: expected one of {', '.join(_MODES)}")
    return value


def margin() -> float:
    """``POLYKERNEL_TUNE_MARGIN``: how much faster than the static choice a winner must be (0.03)."""
    raw = os.environ.get("POLYKERNEL_TUNE_MARGIN")
    if raw is None or not raw.strip():
        return DEFAULT_MARGIN
    try:
        value = float(raw.strip())
    except ValueError:
        value = float("nan")
    if not 0.0 <= value < 1.0:
        raise ValueError(f"POLYKERNEL_TUNE_MARGIN={_shown(raw)}: expected a fraction in [0, 1), e.g. 0.03")
    return value


def calls() -> float:
    """``POLYKERNEL_TUNE_CALLS``: over how many calls of a key measured selection spreads an
    impl's per-process compile (100000); a process that calls a key once should say 1."""
    raw = os.environ.get("POLYKERNEL_TUNE_CALLS")
    if raw is None or not raw.strip():
        return float(DEFAULT_CALLS)
    try:
        value = float(raw.strip())
    except ValueError:
        value = float("nan")
    if not value >= 1.0:  # NaN too
        raise ValueError(f"POLYKERNEL_TUNE_CALLS={_shown(raw)}: expected a number of calls >= 1, e.g. 100000")
    return value


def store() -> Store:
    """This process's store for the current environment identity (created on first use)."""
    global _store
    hit = _store
    if hit is None:
        from . import json_store as tuning_store
        from . import key as tuning_key

        with _lock:
            if _store is None:
                _store = tuning_store.Store(tuning_store.cache_dir(), tuning_key.identity())
            hit = _store
    return hit


def stores_class(op: OpLike, argkey: tuple[Any, ...], deterministic: bool = False) -> bool:
    """Whether the store holds an entry for some size bucket of this argument class (cached
    mode, the decision's miss path): its first call's bucket may have none, and the others
    must still find theirs (see :mod:`.by_size`). False when tuning is off or the store empty."""
    if mode() == "off":
        return False
    st = store()
    if st.empty():
        return False
    from . import key as tuning_key

    # the key's JSON up to its tensors (the same text for every bucket of the class)
    prefix = tuning_key.key(op, argkey, (), deterministic).removesuffix("[]}")
    return any(k.startswith(prefix) for k in st.entries())


def _measurable(args: Sequence[Any], capturing: bool) -> bool:
    import torch

    if capturing or getattr(_busy, "active", False) or torch.compiler.is_compiling() or torch.jit.is_tracing():
        return False
    for a in args:
        if isinstance(a, torch.Tensor) and (type(a) not in (torch.Tensor, torch.nn.Parameter) or a.device.type == "meta"):
            return False
    return True


def lookup(
    op: OpLike,
    argkey: tuple[Any, ...],
    args: Sequence[Any] | None = None,
    rows: Sequence[Any] = (),
    capturing: bool = False,
    measure: bool = False,
    deterministic: bool = False,
) -> str | None:
    """The tuned impl name for this call, or None (then static ranks decide).

    ``args`` are the call's real arguments (None: answer from what this argument class met
    before); ``rows`` the dispatcher's verdicts in rank order (the candidates); ``measure``: the
    caller is the op's miss path, where measuring is allowed (``POLYKERNEL_TUNE=on``).
    """
    collect = _collect.get()
    the_mode = mode()
    if the_mode == "off" and collect is None:
        return None
    pinned = _pinned.get((op.id, argkey))
    if pinned is not None:
        return pinned
    if args is None:
        seen = _seen.get((op.id, argkey))
        return None if seen is None else _choice(seen[1], capturing)
    st = store()
    if collect is None and the_mode == "cached" and st.empty():
        return None
    import torch

    from . import key as tuning_key

    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    key = tuning_key.key(op, argkey, tensors, deterministic)
    entry = None if collect is not None else st.get(key)
    if entry is None and measure and (the_mode == "on" or collect is not None) and _measurable(args, capturing):
        # Threads that meet a new key at once measure it once: the others wait for the entry.
        with _measuring:
            entry = None if collect is not None else st.get(key)
            if entry is None:
                entry = _measure(op, argkey, tuple(args), rows, key, collect)
    if entry is None:
        return None
    _seen[(op.id, argkey)] = (key, entry)
    return _choice(entry, capturing)


def _choice(entry: dict[str, Any], capturing: bool) -> str | None:
    name = entry.get("graph") if capturing else entry.get("eager")
    return name if isinstance(name, str) else None


def _measure(
    op: OpLike, argkey: tuple[Any, ...], args: tuple[Any, ...], rows: Sequence[Any], key: str, collect: list[dict[str, Any]] | None
) -> dict[str, Any] | None:
    from . import measure as tm

    names = [v.name for v in rows if v.runnable]
    if not names:
        return None
    specs = registry.specs_for(op)
    candidates, times = {}, {}
    for name in names:
        try:
            candidates[name] = registry.load_impl(specs[name])
        except Exception as exc:  # not runnable after all: infinitely slow
            times[name] = tm.Timing(error=f"import failed: {type(exc).__name__}: {exc}")
    _busy.active = True
    try:
        with verify.paused():  # measuring checks parity itself: no first-call verification inside
            times.update(tm.measure(op, candidates, args, argkey[1], bool(argkey[2])))
    except tm.ReferenceFailed as exc:
        log.warning("polykernel: %s: not tuned, parity cannot be checked on these arguments (%s)", op.id, exc)
        return None
    finally:
        _busy.active = False
    graph_safe = [n for n in names if specs[n].cuda_graph_safe]
    entry = tm.choose(times, names, graph_safe, margin(), calls())
    if collect is not None:
        collect.append({"key": key, "op": op.id, "order": names, "graph_safe": graph_safe, "times": times})
    else:
        store().put({key: entry})
    log.info("polykernel: %s: tuned %s -> %s", op.id, key, entry["eager"])
    return entry


def remember(op: OpLike, argkey: tuple[Any, ...], impl: str) -> None:
    """Record a decision for ``(op, argkey)`` in this process only; memoized decisions are dropped."""
    _pinned[(op.id, argkey)] = impl
    registry.changed()


def measured(op: OpLike, argkey: tuple[Any, ...]) -> dict[str, Any] | None:
    """What ``explain`` shows for a tuned choice: the store key and entry (times in ms)."""
    pinned = _pinned.get((op.id, argkey))
    if pinned is not None:
        return {"key": None, "eager": pinned, "times": {}, "note": "remembered in-process, not measured"}
    seen = _seen.get((op.id, argkey))
    return None if seen is None else {"key": seen[0], **seen[1]}


def clear_cache() -> None:
    """Forget in-process decisions and re-read the store on next use (``clear_caches`` calls this)."""
    global _store
    from . import json_store as tuning_store

    with _lock:
        _store = None
        _pinned.clear()
        _seen.clear()
    tuning_store.reset_warnings()


# -- ahead of time and distributed -------------------------------------------------------------


@contextlib.contextmanager
def collecting() -> Iterator[list[dict[str, Any]]]:
    """Within the block, every op call on a new key measures (whatever the mode) and appends a
    record ``{key, op, order, graph_safe, times}`` to the yielded list; nothing is stored."""
    records: list[dict[str, Any]] = []
    token = _collect.set(records)
    try:
        yield records
    finally:
        _collect.reset(token)


def decide_and_store(records: Sequence[dict[str, Any]], persist: bool = True) -> dict[str, dict[str, Any]]:
    """Store entries for measurement records (several records of one key: the slowest times win)."""
    from . import measure as tm

    by_key: dict[str, list[dict[str, Any]]] = {}
    for rec in records:
        by_key.setdefault(rec["key"], []).append(rec)
    entries = {}
    for key, recs in by_key.items():
        times = tm.slowest([r["times"] for r in recs])
        entries[key] = tm.choose(times, recs[0]["order"], recs[0]["graph_safe"], margin(), calls())
    if persist and entries:
        store().put(entries)
    with _lock:
        _seen.clear()
    registry.changed()
    return entries


def sync_decisions(group: Any = None) -> int:
    """Collective: every rank adopts rank 0's decisions for the keys rank 0 has.

    Every rank of ``group`` must call it (e.g. after the first step); it never runs inside an op
    call. Returns the number of entries rank 0 has; without an initialized process group it
    does nothing and returns 0::

        >>> import polykernel
        >>> polykernel.sync_decisions()
        0
    """
    try:
        import torch.distributed as dist
    except ImportError:
        return 0
    if not dist.is_available() or not dist.is_initialized():
        return 0
    src = dist.get_global_rank(group, 0) if group is not None else 0
    payload: list[Any] = [store().entries() if dist.get_rank() == src else None]
    dist.broadcast_object_list(payload, src=src, group=group)
    entries = payload[0] if isinstance(payload[0], dict) else {}
    if dist.get_rank() != src:
        store().adopt(entries)
        with _lock:
            _seen.clear()
        registry.changed()  # memoized decisions re-resolve against rank 0's entries
    return len(entries)
