"""Introspection: ``explain`` (what would run for a call, and why), ``available_impls`` and
``decisions`` (what ran since the last ``clear_caches``)."""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ...errors import ImplNotAvailableError, OpTypeError
from ...spec import PlatformInfo
from .. import hooks, memo_key, registry
from ..explain_args import call_args, device_arg, dtype_arg, rejection
from . import resolution
from .resolution import _record
from .state import _scope, collected_notes
from .subclasses import INFERENCE, subclass_name
from .verdicts import Verdict, _probe_imports, _verdicts

if TYPE_CHECKING:
    from ..protocols import OpLike


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
    notes: list[str] = field(default_factory=list)  # the lines the call would log once (a preference skipped)

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
        lines.extend(f"  note: {note}" for note in self.notes)
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
            "notes": self.notes,
        }


def _tuned_times(op: OpLike, argkey: tuple[Any, ...]) -> dict[str, Any] | None:
    from ... import tuning

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
    op: OpLike, args: tuple[Any, ...], kwargs: dict[str, Any], device: Any, dtype: Any, needs_grad: bool = False
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
    op: str,
    *args: Any,
    device: Any = None,
    dtype: Any = None,
    impl: str | None = None,
    needs_grad: bool = False,
    capturing: bool | None = None,
    **kwargs: Any,
) -> Explanation:
    """What would run for this call, and why: every impl with its verdict and reason.

    Give the call's own arguments, or just ``device=``/``dtype=`` (a ``torch.dtype`` or its name:
    ``"bf16"``, ``"float16"``...) and ``needs_grad=True`` for a call whose inputs require grad
    (with arguments, their ``requires_grad`` decides and ``needs_grad`` must be left False).
    ``capturing=True`` (or False) explains the call as made while a CUDA graph is captured (or
    eagerly); left None, as it is made here and now. The op's validation runs as in the call: bad arguments raise
    its error (a missing one the call's ``TypeError``); a dtype the op rejects leaves no impl
    chosen, with the op's error in ``error``::

        >>> import polykernel, torch
        >>> print(polykernel.explain("rms_norm", torch.randn(4, 8), torch.ones(8)))  # doctest: +SKIP
        norm.rms_norm on cpu
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
    if capturing is None:
        capturing = argkey[0].type == "cuda" and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    capturing = bool(capturing) and argkey[0].type == "cuda"  # (a CPU call is never captured)
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
    elif call is not None and the_op.inference_call(call):  # as the call: its own key, the torch impl only
        key = key._replace(subclass=INFERENCE)
    chosen = source = error = None
    notes: list[str] = []
    rejected = None if args else rejection(the_op, None, argkey[1])
    if rejected is not None:  # the call would raise this before choosing: no impl runs
        error = str(rejected)
        why = f"dtype {_short(argkey[1])} not supported" if isinstance(rejected, OpTypeError) else f"arguments rejected: {error}"
        rows = [Verdict(v.name, v.rank, why, v.rank_note) for v in _verdicts(the_op, argkey, key.deterministic, capturing, subclass)]
    else:
        try:
            tensors = (*args, *kwargs.values()) if args else None  # tuning keys on the call's tensors
            with collected_notes() as notes:  # the call logs them (once), not explain
                d = _memoized(the_op, key) or resolution._resolve(the_op, key, tensors)
            chosen, source, rows = d.impl, d.source, d.verdicts
        except ImplNotAvailableError as exc:
            error = str(exc)
            rows = _verdicts(the_op, argkey, key.deterministic, capturing, key.subclass)
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
        notes=notes,
    )


def _memoized(op: OpLike, key: memo_key.MemoKey) -> Any:
    """The decision the call would run from the op's memo (a fallback after a runtime fault, one
    made before an env variable changed), else None: resolved afresh. A per-size-bucket decision
    is resolved afresh too (its impl depends on the call's bucket, which resolution looks up)."""
    try:
        d = op.memoized(key)
    except TypeError:  # an unhashable option: the call's error, from resolution's path
        return None
    return d if d is not None and d.by_size is None else None


def available_impls(op: str, device: Any = None, dtype: Any = None) -> list[str]:
    """Names of the impls that can run for ``op`` on ``device``/``dtype``, in selection order.

    >>> import polykernel
    >>> "torch" in polykernel.available_impls("rms_norm", device="cpu")  # ['torch', 'torch_compile'] on a CPU
    True
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
